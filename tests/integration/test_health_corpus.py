"""HealthMonitor's corpus machinery on a few cases, and the two reference detectors on programs they must catch.

HealthMonitor's own accuracy is not asserted here: it is what ``benchmarks/health.py`` measures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from benchmarks.health_cases import SYMPTOMS, Case, buggy, quick
from benchmarks.reference_detectors import (
    AutoTrainer,
    DeepDiagnosis,
    LayerOutput,
    ReferenceDetector,
    ReferenceFinding,
    oscillating,
    out_of_range,
)
from tests.support.helpers import TinyNet, hook_state, make_trainer

ROOT = Path(__file__).resolve().parents[2]
DETECTORS = ["HealthMonitor", "AutoTrainer", "DeepDiagnosis"]


def case(program: str, fixed: bool = False) -> Case:
    name = f"{'fixed: ' if fixed else ''}{program} #0"
    return next(c for c in buggy(1) if c.name == name)


def fit(case: Case, detector: ReferenceDetector, tmp_path: Path) -> list[ReferenceFinding]:
    """``case`` fitted with ``detector`` alone in the Trainer."""
    pl.seed_everything(case.seed, verbose=False)
    model, data = case.build()
    make_trainer(tmp_path, [detector], logger=False, max_steps=case.steps).fit(model, datamodule=data)
    return detector.findings


def test_the_quick_corpus_prints_each_run_and_each_check_for_the_three_detectors() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/health.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.strip("|").split(" | ") for line in out.stdout.splitlines() if line.startswith("| ")]
    header = rows[0]
    assert header[4:7] == DETECTORS
    runs = {row[0].strip(): row for row in rows[1:] if len(row) == len(header)}
    assert set(runs) == {c.name for c in quick()}
    for row in runs.values():
        assert all(cell.strip() and not cell.startswith("ERROR") for cell in row[4:7]), row
        first, last = (float(x) for x in row[7].split(" → "))
        assert last < first  # the healthy runs and the twin learn; the dead ReLU barely does, but does not rise
    summary = [row for row in rows if len(row) == 6 and row[1].strip() in DETECTORS]
    checks = [row[0].strip() for row in summary[:: len(DETECTORS)]]
    assert checks == [f"`{s}`" for s in SYMPTOMS] + ["**all**"]
    assert all(row[1].strip() == d for row, d in zip(summary, DETECTORS * len(checks), strict=True))
    overall = {row[1].strip(): row for row in summary[-len(DETECTORS) :]}
    for detector in DETECTORS:
        assert overall[detector][2].endswith("/1)")  # one buggy run, scored for every detector
        assert overall[detector][3].endswith("/3)")  # two healthy runs and one fixed twin
    assert "2 healthy runs over 2 architectures" in out.stdout


def test_deepdiagnosis_names_the_dead_relu_at_the_first_check(tmp_path: Path) -> None:
    found = fit(case("ReLU behind a bias of -10"), DeepDiagnosis(every=2), tmp_path)
    assert [(f.check, f.layer, f.step) for f in found] == [("dead_units", "net.1", 0)]
    assert found[0].rule in ("numerical error (zero)", "dead node")


def test_deepdiagnosis_names_the_layer_whose_output_is_not_finite(tmp_path: Path) -> None:
    found = fit(case("log of a ReLU's zeros"), DeepDiagnosis(every=2), tmp_path)
    assert [(f.rule, f.check, f.layer, f.step) for f in found] == [("exploding tensor", "nonfinite", "net.2", 0)]


def test_deepdiagnosis_finds_no_dead_relu_in_the_fixed_twin(tmp_path: Path) -> None:
    found = fit(case("ReLU behind a bias of -10", fixed=True), DeepDiagnosis(every=2), tmp_path)
    assert all(f.check != "dead_units" for f in found)


def test_autotrainer_diagnoses_vanishing_gradients_in_the_first_layer_once_it_judges(tmp_path: Path) -> None:
    detector = AutoTrainer(every=10)
    found = fit(case("20 sigmoid layers under SGD"), detector, tmp_path)
    assert [(f.rule, f.check, f.layer) for f in found] == [("vanishing gradient", "vanishing_gradients", "net.0")]
    assert found[0].step == 19  # the end of the second of six epochs: 30 % of the run
    assert detector.done


def test_autotrainer_reports_nan_at_the_end_of_the_first_epoch(tmp_path: Path) -> None:
    found = fit(case("standardising by a zero std"), AutoTrainer(every=10), tmp_path)
    assert [(f.rule, f.check, f.layer, f.step) for f in found] == [("exploding (NaN)", "nonfinite", None, 9)]


@pytest.mark.parametrize("detector", [AutoTrainer(every=2), DeepDiagnosis(every=2)], ids=lambda d: type(d).__name__)
def test_every_hook_is_removed_after_a_fit_and_after_a_failed_one(detector: ReferenceDetector, tmp_path: Path) -> None:
    model = TinyNet()
    before = hook_state(model)
    make_trainer(tmp_path, [detector], logger=False, max_steps=4).fit(model)
    assert hook_state(model) == before
    failing = TinyNet(fail_at=3)
    with pytest.raises(RuntimeError, match="planned failure"):
        make_trainer(tmp_path, [detector], logger=False, max_steps=6).fit(failing)
    assert hook_state(failing) == hook_state(TinyNet())


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.5, 0.6, 0.7, 0.8, 0.9], False),  # rising
        ([0.5, 0.6, 0.5, 0.6, 0.5, 0.6], True),  # peaks and troughs 0.1 apart
        ([0.5, 0.51, 0.5, 0.51, 0.5, 0.51], False),  # 0.01 apart: below zeta
    ],
)
def test_autotrainer_oscillation_needs_peaks_and_troughs_zeta_apart(values: list[float], expected: bool) -> None:
    assert oscillating(values, AutoTrainer.ZETA, AutoTrainer.ETA) is expected


@pytest.mark.parametrize(
    ("kind", "low", "high", "targets", "expected"),
    [
        ("sigmoid", 0.1, 0.9, (0.0, 1.0), False),
        ("sigmoid", 0.1, 0.9, (0.0, 300.0), True),  # targets a sigmoid cannot reach
        ("tanh", -0.5, 0.5, (-2.0, 0.0), True),
        ("other", -1.0, 1.0, (-1.0, 1.0), False),
        ("other", -30.0, 30.0, (-1.0, 1.0), True),  # a linear output spread 30 times wider than the targets
    ],
)
def test_deepdiagnosis_out_of_range(
    kind: str, low: float, high: float, targets: tuple[float, float], expected: bool
) -> None:
    last = LayerOutput(kind=kind, mean=0.0, finite=True, nonpositive=0.5, low=low, high=high)
    assert out_of_range(last, targets, DeepDiagnosis.WIDER) is expected


def test_a_check_period_below_one_step_is_refused() -> None:
    with pytest.raises(ValueError, match="`DeepDiagnosis` got `every=0`; `every` must be a positive number of steps"):
        DeepDiagnosis(every=0)


def test_the_reference_detectors_do_not_import_lightning_hooks() -> None:
    code = (
        "import sys; import benchmarks.reference_detectors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning_hooks'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_case_builds_the_same_model_and_data_under_the_same_seed() -> None:
    def first_batch(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
        pl.seed_everything(c.seed, verbose=False)
        model, data = c.build()
        assert data is not None
        x, _ = next(iter(data.train_dataloader()))
        return x, next(model.parameters()).detach()

    one, two = first_batch(case("ReLU behind a bias of -10")), first_batch(case("ReLU behind a bias of -10"))
    assert torch.equal(one[0], two[0])
    assert torch.equal(one[1], two[1])
