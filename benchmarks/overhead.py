"""Per-step cost of each callback against the same Lightning fit without it.

    .venv/bin/python benchmarks/overhead.py [--repeats 7] [--steps 120] [--every 50]

Variants run interleaved (A B C A B C ...) so that drifting machine load hits all of them alike;
each figure is a median over repeats of the per-step median inside one fit. Ratios are against
the Lightning fit with no callback, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.digits import DigitsCNN, DigitsDataModule  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import GradClamp, ShapeLogger  # noqa: E402


class StepTimer(pl.Callback):
    """Wall time of each training step, batch start to batch end."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step = trainer.global_step
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append((self._step, time.perf_counter() - self._start))


WORKLOADS: dict[str, Callable[[], tuple[pl.LightningModule, pl.LightningDataModule]]] = {
    "digits-cnn": lambda: (DigitsCNN(), DigitsDataModule(batch_size=64)),
    "transformer": lambda: (TinyTransformerLM(), TokenDataModule()),
}


Variants = dict[str, tuple[Callable[[], list[pl.Callback]], dict[str, Any]]]
"""Name to (a factory of the callbacks, extra Trainer arguments)."""


def variants(value: float) -> Variants:
    return {
        "lightning": (lambda: [], {}),
        "ShapeLogger": (lambda: [ShapeLogger()], {}),
        "GradClamp": (lambda: [GradClamp(value)], {}),
        "gradient_clip_val": (lambda: [], {"gradient_clip_val": value, "gradient_clip_algorithm": "value"}),
        "all": (lambda: [ShapeLogger(), GradClamp(value)], {}),
    }


def run_once(
    workload: str, callbacks: list[pl.Callback], trainer_kwargs: dict[str, Any], steps: int, every: int, root: str
) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=every,
        logger=TensorBoardLogger(root, name=workload),
        callbacks=[*callbacks, timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the shape table is printed once per fit
        trainer.fit(model, datamodule=data)
    return timer.times


def interleaved(
    workload: str, table: Variants, repeats: int, steps: int, every: int, root: str
) -> Iterator[tuple[str, list[tuple[int, float]]]]:
    """``(variant, step times of one fit)``, the variants taking turns (A B C A B C ...) ``repeats`` times."""
    for _ in range(repeats):
        for name, (make_callbacks, kwargs) in table.items():
            yield name, run_once(workload, make_callbacks(), kwargs, steps, every, root)


def arguments(description: str | None, steps: int) -> argparse.ArgumentParser:
    """The options every benchmark here takes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    return parser


def machine() -> str:
    """What the figures were measured with."""
    return f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads"


def prepare(args: argparse.Namespace) -> None:
    """Set the thread count asked for; no warnings and no Lightning chatter between the figures."""
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def main() -> None:
    parser = arguments(__doc__, steps=120)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    prepare(args)
    table = variants(0.2)
    print(f"{machine()}, {args.repeats} repeats x {args.steps} steps, log_every_n_steps={args.every}")
    with tempfile.TemporaryDirectory() as root:
        for workload in args.workloads:
            all_steps: dict[str, list[float]] = {name: [] for name in table}
            quiet_steps: dict[str, list[float]] = {name: [] for name in table}
            for name, times in interleaved(workload, table, args.repeats, args.steps, args.every, root):
                times = [(s, t) for s, t in times if s >= args.warmup]
                all_steps[name].append(statistics.mean(t for _, t in times))
                quiet_steps[name].append(statistics.median(t for s, t in times if s % args.every))
            base_all = statistics.median(all_steps["lightning"])
            base_quiet = statistics.median(quiet_steps["lightning"])
            print(f"\n{workload}: mean step {base_all * 1e3:.2f} ms without callbacks")
            print(f"{'variant':<20}{'ms/step':>9}{'ratio (all steps)':>20}{'ratio (non-logging)':>22}")
            for name in table:
                mean_all = statistics.median(all_steps[name])
                quiet = statistics.median(quiet_steps[name])
                print(f"{name:<20}{mean_all * 1e3:>9.2f}{mean_all / base_all:>20.3f}{quiet / base_quiet:>22.3f}")


if __name__ == "__main__":
    main()
