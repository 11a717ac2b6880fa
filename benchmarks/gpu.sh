#!/usr/bin/env bash
# What a lent GPU machine runs (issue #35): the CUDA tests, then benchmarks/gpu.py; results under $OUT.
# Its image has torch, Lightning, TensorBoard and transformers; google-crc32c comes along as a wheel in .wheels/.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
python3 -m pip install --quiet --no-deps --no-index .wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/card.txt"
python3 -c "import torch, lightning, transformers; print(torch.__version__, lightning.__version__, transformers.__version__)" \
    | tee -a "$OUT/card.txt"
[ "${TESTS_S:-150}" = 0 ] || timeout -k 10 "${TESTS_S:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider --durations=5 \
    tests/callbacks/test_on_device.py tests/callbacks/test_sync_free.py tests/callbacks/test_nonfinite_replay.py \
    tests/callbacks/test_memory_logger.py tests/integration/test_compile.py \
    >"$OUT/pytest.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
# Lightning catches SIGTERM and ends a fit only between steps (a compile can run for minutes), so KILL follows; every
# thread's stack is printed every 100 s.
BENCH_S=${BENCH_S:-400}
# GPU_ARGS picks what gpu.py runs (e.g. '--modes compiled --sections time --variants "without callbacks" GradClamp').
eval "timeout -k 15 $BENCH_S python3 benchmarks/gpu.py --out \"$OUT\" --budget ${BUDGET_S:-330} \
    --stacks-after 100 ${GPU_ARGS:-}" >"$OUT/gpu.log" 2>&1
echo "gpu.py rc $?"
cat "$OUT/gpu.md" 2>/dev/null || tail -40 "$OUT/gpu.log"
grep -E "^\[|failed" "$OUT/gpu.log" | tail -20
