"""HealthMonitor measured on a corpus, beside two published rule sets: does it find what is wrong, in the
right layer, soon, and leave healthy runs alone?

    .venv/bin/python benchmarks/health.py                 # the whole corpus (benchmarks/health_cases.py)
    .venv/bin/python benchmarks/health.py --quick         # four cases: a smoke run
    .venv/bin/python benchmarks/health.py --only "ReLU behind a bias of -10" --seeds 3

Every case is one fit with ``HealthMonitor(log_every_n_steps=EVERY)`` (its defaults otherwise) and the two
reference detectors of ``benchmarks/reference_detectors.py`` in the same Trainer: DeepDiagnosis' rules checking
at the same period, AutoTrainer's once an "epoch" of ``EPOCH = 10`` steps (its rules read per-epoch accuracy).
``EVERY = 2``: a check that must hold on three logging steps in a row can then be reported four steps after
the symptom appears, inside the five steps the targets allow.

For each detector and check, and over all checks:

* recall: the share of the buggy runs with that symptom where the detector reported that check (or one the
  case accepts as well) at or after the step the symptom became measurable;
* false alarms: the share of the healthy runs and fixed twins where it reported that check (overall: anything);
* first layer: of the detections whose ground truth names a layer, the share whose first named layer is it;
* steps to report: the median of the optimizer steps from ``measurable_step`` to the step at whose end the
  finding was first there to read (for HealthMonitor, when it appeared in ``findings``).

The corpus' ground truth was written before any detector ran on it; the tables are measurements, not targets.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.health_cases import SYMPTOMS, Case, CorpusModule, corpus, quick  # noqa: E402
from benchmarks.planted import (  # noqa: E402, F401 - the callback tests fit them as `benchmarks.health.<name>`
    Planted,
    dead_relu,
    deep_linear,
    fast_layer,
    hot_layer,
    mlp,
    planted_model,
    sigmoid_mlp,
)
from benchmarks.reference_detectors import AutoTrainer, DeepDiagnosis  # noqa: E402
from lightning_hooks import HealthMonitor  # noqa: E402

EVERY = 2
EPOCH = 10
"""AutoTrainer's check period: its features are per-epoch means of the accuracy; 10 steps are 160-320 samples."""
DETECTORS = ("HealthMonitor", "AutoTrainer", "DeepDiagnosis")


@dataclass(frozen=True)
class Report:
    """A finding as the scoring sees it: its check, first named layer, and the step it was reported at."""

    check: str
    layer: str | None
    reported: int


@dataclass
class Outcome:
    """One case's fit: each detector's reports in the order they came, the loss at the start and the end."""

    case: Case
    reports: dict[str, list[Report]] = field(default_factory=dict)
    loss: tuple[float, float] = (float("nan"), float("nan"))
    seconds: float = 0.0
    error: str | None = None


class ReportClock(pl.Callback):
    """Notes the optimizer step at whose end each of a ``HealthMonitor``'s findings first appeared (put it
    after the monitor in ``callbacks``), and the losses of the run."""

    def __init__(self, monitor: HealthMonitor) -> None:
        self.monitor = monitor
        self.reports: list[Report] = []
        self.losses: list[float] = []
        self._seen: set[tuple[str, tuple[str, ...]]] = set()
        self._step = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss))
        self._note(self._step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(self._step)

    def _note(self, step: int) -> None:
        for finding in self.monitor.findings:
            key = (finding.check, finding.layers)
            if key not in self._seen:
                self._seen.add(key)
                self.reports.append(Report(finding.check, finding.layers[0] if finding.layers else None, step))


def run(case: Case) -> Outcome:
    """Fit ``case`` with the three detectors; a failure is kept in the outcome, not raised."""
    outcome = Outcome(case)
    started = time.monotonic()
    try:
        pl.seed_everything(case.seed, verbose=False)
        model, data = case.build()
        targets = model.regression_targets if isinstance(model, CorpusModule) else None
        monitor = HealthMonitor(log_every_n_steps=EVERY)
        clock = ReportClock(monitor)
        references = {
            "AutoTrainer": AutoTrainer(every=EPOCH, targets=targets),
            "DeepDiagnosis": DeepDiagnosis(every=EVERY, targets=targets),
        }
        trainer = pl.Trainer(
            max_steps=case.steps,
            **precision(case),
            callbacks=[monitor, clock, *references.values()],
            logger=False,
            log_every_n_steps=EVERY,
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        with contextlib.redirect_stdout(io.StringIO()):  # the monitor's summary at the end of the fit
            trainer.fit(model, datamodule=data)
        outcome.reports["HealthMonitor"] = clock.reports
        for name, detector in references.items():
            outcome.reports[name] = [Report(f.check, f.layer, f.step) for f in detector.findings]
        head, tail = clock.losses[:5], clock.losses[-5:]
        outcome.loss = (statistics.fmean(head), statistics.fmean(tail)) if head else outcome.loss
    except Exception as error:  # noqa: BLE001 - one broken case must not end the measurement
        outcome.error = f"{type(error).__name__}: {error}".splitlines()[0][:200]
    outcome.seconds = time.monotonic() - started
    return outcome


def precision(case: Case) -> dict[str, Any]:
    """The Trainer's arguments for ``case.precision``: ``"16-mixed"`` is fp16 autocast with a ``GradScaler``, which
    Lightning would turn into bf16 on a CPU unless given as a plugin."""
    if case.precision == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": case.precision}


def detection(case: Case, reports: Sequence[Report]) -> Report | None:
    """The first report of the case's symptom (or of one it accepts as well) made once it was measurable."""
    wanted = {case.symptom, *case.also}
    step = case.measurable_step or 0
    return next((r for r in reports if r.check in wanted and r.reported >= step), None)


def share(hits: int, total: int) -> str:
    return f"{hits / total:.2f} ({hits}/{total})" if total else "-"


def summary(outcomes: Sequence[Outcome], detector: str, check: str | None) -> list[str]:
    """Recall, false alarms, first layer right and median steps of ``detector`` for ``check`` (``None``: all)."""
    done = [o for o in outcomes if o.error is None]
    buggy = [o for o in done if o.case.symptom is not None and check in (None, o.case.symptom)]
    clean = [o for o in done if o.case.symptom is None]
    found = [(o.case, r) for o in buggy if (r := detection(o.case, o.reports[detector])) is not None]
    alarms = sum(any(check in (None, r.check) for r in o.reports[detector]) for o in clean)
    placed = [(case, r) for case, r in found if case.layer is not None]
    right = sum(r.layer == case.layer for case, r in placed)
    delays = [r.reported - (case.measurable_step or 0) for case, r in found]
    median = f"{statistics.median(delays):g}" if delays else "-"
    return [share(len(found), len(buggy)), share(alarms, len(clean)), share(right, len(placed)), median]


def said(reports: Sequence[Report], shown: int = 2) -> str:
    """The first ``shown`` reports as ``check layer @step``, and how many more."""
    parts = [f"{r.check} `{r.layer}` @{r.reported}" if r.layer else f"{r.check} @{r.reported}" for r in reports[:shown]]
    more = [f"+{len(reports) - shown} more"] if len(reports) > shown else []
    return "; ".join(parts + more) or "none"


def verdict(outcome: Outcome, detector: str) -> str:
    reports = outcome.reports[detector]
    case = outcome.case
    if case.symptom is None:
        return "ok" if not reports else f"ALARM: {said(reports)}"
    hit = detection(case, reports)
    if hit is None:
        return f"missed ({said(reports)})"
    if case.layer is None:
        where = ""
    elif hit.layer == case.layer:
        where = " right layer"
    else:
        where = f" in `{hit.layer}`" if hit.layer else " no layer named"
    return f"found +{hit.reported - (case.measurable_step or 0)}{where}"


def print_runs(outcomes: Sequence[Outcome]) -> None:
    print("| run | family | precision | expected | " + " | ".join(DETECTORS) + " | loss first → last | s |")
    print("|---|---|---|---|" + "---|" * len(DETECTORS) + "---|---:|")
    for o in outcomes:
        case = o.case
        expected = (
            "nothing" if case.symptom is None else f"{case.symptom} `{case.layer}`" if case.layer else case.symptom
        )
        if case.symptom is not None:
            expected += f" from {case.measurable_step}"
        if o.error is not None:
            cells = [f"ERROR {o.error}"] + [""] * (len(DETECTORS) - 1)
        else:
            cells = [verdict(o, d) for d in DETECTORS]
        row = [case.name, case.family, case.precision, expected, *cells, f"{o.loss[0]:.3g} → {o.loss[1]:.3g}"]
        print(f"| {' | '.join(row)} | {o.seconds:.1f} |")


def print_summary(outcomes: Sequence[Outcome]) -> None:
    print("| check | detector | recall | false alarms (healthy + fixed) | first layer right | median steps to report |")
    print("|---|---|---:|---:|---:|---:|")
    for check in (*SYMPTOMS, None):
        for detector in DETECTORS:
            row = ["**all**" if check is None else f"`{check}`", detector, *summary(outcomes, detector, check)]
            print(f"| {' | '.join(row)} |")


def describe(cases: Sequence[Case], seeds: int) -> str:
    healthy = [c for c in cases if c.symptom is None and not c.name.startswith("fixed: ")]
    buggy = [c for c in cases if c.symptom is not None]
    programs = dict.fromkeys(c.program for c in buggy)
    optimizers = sorted({c.optimizer.split(" ")[0] for c in healthy})
    return (
        f"{len(healthy)} healthy runs over {len({c.family for c in healthy})} architectures "
        f"({', '.join(dict.fromkeys(c.family for c in healthy))}), optimizers {', '.join(optimizers)}, "
        f"{sum(c.precision == 'bf16-mixed' for c in healthy)} of them in bf16-mixed and "
        f"{sum(c.precision == '16-mixed' for c in healthy)} in fp16 with a GradScaler; {len(programs)} buggy programs "
        f"under {seeds} seed(s), {len(buggy)} buggy runs and as many fixed twins."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two healthy runs, one buggy program and its twin")
    parser.add_argument("--only", nargs="*", metavar="RUN", help="these runs or programs only (names as in the table)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of each buggy program and its twin (default 2)")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = quick() if args.quick else corpus(args.seeds)
    if args.only:
        cases = [
            c
            for c in cases
            if c.name in args.only or c.program in args.only or c.program.removeprefix("fixed: ") in args.only
        ]
    started = time.monotonic()
    outcomes = []
    for i, case in enumerate(cases, 1):
        outcomes.append(run(case))
        print(f"[{i}/{len(cases)}] {case.name}: {outcomes[-1].seconds:.1f} s", file=sys.stderr, flush=True)
    import transformers

    print(
        f"HealthMonitor(log_every_n_steps={EVERY}) with its defaults; DeepDiagnosis every {EVERY} steps, AutoTrainer "
        f"every {EPOCH}; torch {torch.__version__}, transformers {transformers.__version__}, one CPU thread.\n"
    )
    print(describe(cases, 1 if args.quick else args.seeds) + "\n")
    print_runs(outcomes)
    print()
    print_summary(outcomes)
    print(f"\n{len(outcomes)} runs in {time.monotonic() - started:.0f} s.")


if __name__ == "__main__":
    main()
