"""The overhead benchmark's machinery: callgrind's instruction meter and a tiny timed run."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _callgrind
from lightning_hooks.diagnose.health import CHECKS

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
        + ["torch's foreach clamp alone @2"]
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    names = [row.split(" | ")[0] for row in rows]
    assert names == ["| lightning @2", "| GradClamp @2", "| torch's foreach clamp alone @2", "| lightning @2, again"]
    assert "ms per step in Lightning without callbacks" in out


def test_the_logging_step_split_prints_every_part() -> None:
    out = output_of(
        [sys.executable, "benchmarks/logging_step.py", "--workload", "digits-cnn", "--repeats", "1"]
        + ["--steps", "8", "--every", "2", "--floor"]
    )
    [row] = [line for line in out.splitlines() if line.startswith("| this checkout |")]
    assert len(row.split(" | ")) == 7
    floors = [line.split(" | ") for line in out.splitlines() if "(floor) |" in line]
    assert [cells[0] for cells in floors] == [
        "| hooks that do nothing (floor)",
        "| hooks + one sum per tensor (floor)",
        "| hooks + copies + six statistics in rows (floor)",
        "| the same + parameter gradients (floor)",
    ]
    assert "reduction kernels | host work per key | event writing | writer thread" in out


def test_the_health_calibration_prints_each_run_and_each_check() -> None:
    out = output_of([sys.executable, "benchmarks/health.py", "--quick", "--only", "dead ReLU", "NumNet"])
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")]
    runs = {row[0]: row for row in rows if row[0] in ("| dead ReLU", "| NumNet")}
    assert runs["| dead ReLU"][3:5] == ["yes", "dead_units net.1 @0; update_ratio net.0 @10 |"]
    assert runs["| NumNet"][3:5] == ["yes", "none |"]
    checks = [row for row in rows if row[0].startswith("| `")]
    assert [row[0] for row in checks] == [f"| `{check}`" for check in CHECKS]
    assert checks[0][1:] == ["1 of 1", "0 |"]
