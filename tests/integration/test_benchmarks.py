"""The overhead benchmark's machinery: callgrind's instruction meter and a tiny timed run."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _callgrind

ROOT = Path(__file__).resolve().parents[2]

COUNTED = """
from benchmarks._callgrind import InstructionMeter

def work(n):
    total = 0
    for i in range(n):
        total += i * i
    return total

meter = InstructionMeter()
work(4000)  # the interpreter specialises the loop's bytecode on its first runs
meter.start()
meter.mark()  # the first stretch also holds the return from start() and ctypes' first lookups
work(1000)
meter.mark()
work(4000)
meter.mark()
work(1000)
meter.mark()
meter.stop()
print(meter.collect())
"""


def output_of(command: list[str], env: dict[str, str] | None = None) -> str:
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=300).stdout


@pytest.mark.skipif(_callgrind.missing_tools() is not None, reason=str(_callgrind.missing_tools()))
def test_the_meter_counts_each_stretch_and_the_counts_repeat(tmp_path: Path) -> None:
    library = _callgrind.build_library(tmp_path)
    command = _callgrind.command([sys.executable, "-c", COUNTED], tmp_path)
    out = output_of(command, env=_callgrind.environment(library, tmp_path))
    _, short, long, again = ast.literal_eval(out.strip().splitlines()[-1])
    assert short == pytest.approx(again, rel=0.01)  # the same work counts the same
    assert long / short == pytest.approx(4, rel=0.2)  # four times the loop, about four times the count
    assert not list(tmp_path.glob("cg.*.*"))  # every dump was read and removed


def test_the_meter_refuses_to_run_outside_valgrind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _callgrind.missing_tools() is not None:
        pytest.skip(str(_callgrind.missing_tools()))
    monkeypatch.setenv(_callgrind.LIBRARY_ENV, str(_callgrind.build_library(tmp_path)))
    monkeypatch.setenv(_callgrind.OUT_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="under valgrind"):
        _callgrind.InstructionMeter()


def test_a_tiny_timed_run_prints_a_table_with_every_variant_asked_for() -> None:
    out = output_of(
        [sys.executable, "benchmarks/overhead.py", "--workloads", "digits-cnn", "--frequencies", "2"]
        + ["--repeats", "1", "--steps", "4", "--warmup", "1", "--no-memory", "--only", "GradClamp @2"]
        + ["GradStats + ActivationStats @2", "torch's foreach clamp alone @2"]
    )
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row[0] for row in rows] == [
        "| lightning @2",
        "| GradClamp @2",
        "| GradStats + ActivationStats @2",
        "| torch's foreach clamp alone @2",
        "| lightning @2, again",
    ]
    assert all(float(row[1]) > 0 for row in rows)  # milliseconds per step
    assert rows[0][2:5] == ["1.000", "1.000", "1.000"]  # the baseline against itself
    assert "ms per step in Lightning without callbacks" in out


def test_the_logging_step_prints_each_code_base_and_each_floor() -> None:
    out = output_of(
        [sys.executable, "benchmarks/logging_step.py", "--workload", "digits-cnn", "--repeats", "1"]
        + ["--steps", "8", "--every", "2", "--floor", "--before", str(ROOT)]
    )
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "| code |" not in line]
    assert [row[0] for row in rows] == [
        f"| before ({ROOT})",
        "| this checkout",
        "| torch hooks that do nothing",
        "| torch hooks + one sum per tensor",
        "| torch hooks + copies + four reductions per shape",
    ]
    for row in rows:
        assert len(row) == 4
        quiet_cpu, quiet_wall = (float(x) for x in row[1].split(" / "))
        assert quiet_cpu > 0
        assert quiet_wall > 0
    assert "| code | quiet step, CPU / wall | logging step's extra, CPU (× quiet) / wall | other threads |" in out
    assert "digits-cnn (" in out
    assert "GradStats + ActivationStats every 2 steps, histograms off" in out


def test_the_gpu_benchmark_runs_on_a_tiny_model_and_writes_its_results(tmp_path: Path) -> None:
    out = output_of(
        [sys.executable, "benchmarks/gpu.py", "--smoke", "--modes", "eager", "--sections", "time", "logging"]
        + ["--out", str(tmp_path)]
    )
    results = json.loads((tmp_path / "gpu.json").read_text())
    timed = results["sections"]["step time (eager)"]
    assert timed["rounds"] == 2
    assert set(timed["ratio"]) == {
        "without callbacks",
        "all six @50",
        "observers @50",
        "NonFiniteGuard",
        "NonFiniteGuard every 10",
    }
    assert timed["ratio"]["without callbacks"] == 1.0
    assert all(ms > 0 for ms in timed["ms_per_step"].values())
    logging_step = results["sections"]["logging step (eager)"]
    assert logging_step["all six"]["logging_ms"] > logging_step["all six"]["quiet_ms"] > 0
    assert set(logging_step) - {"seconds"} == {
        "without callbacks",
        "all six",
        "GradStats + ActivationStats",
        "HealthMonitor",
        "all six, slabs on the device (prototype)",
        "GradStats + ActivationStats, slabs on the device (prototype)",
    }
    assert "| all six @50 |" in out
    assert (tmp_path / "gpu.md").read_text().strip() in out
