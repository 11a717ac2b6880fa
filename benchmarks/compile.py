"""Step times of a torch.compile'd model with and without the observing callbacks.

    .venv/bin/python benchmarks/compile.py [--steps 210] [--repeats 2]

The transformer's encoder is compiled inside the LightningModule. Variants: eager without
callbacks, compiled without callbacks, and compiled with ShapeLogger + GradStats + ActivationStats
at log_every_n_steps=50 with dynamo guarding on hooks (``skip_nnmodule_hook_guards=False``, the
setting the callbacks ask for). Per-step medians of steps that log nothing and of logging steps,
leaving out the first 30 steps and the first logging step (compiles); graph breaks counted by dynamo.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import StepTimer, quiet  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import ActivationStats, GradStats, ShapeLogger  # noqa: E402


def fit(compiled: bool, callbacks: list[pl.Callback], steps: int, root: str) -> list[tuple[int, float, int]]:
    torch.manual_seed(0)
    model, data = TinyTransformerLM(), TokenDataModule()
    if compiled:
        model.encoder = torch.compile(model.encoder)  # type: ignore[assignment]
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        log_every_n_steps=50,
        logger=pl.loggers.TensorBoardLogger(root),
        callbacks=[*callbacks, timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model, datamodule=data)
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=210)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    quiet()
    variants: dict[str, tuple[bool, Any]] = {
        "eager, no callbacks": (False, lambda: []),
        "compiled, no callbacks": (True, lambda: []),
        "compiled, 3 observers @50": (
            True,
            lambda: [
                ShapeLogger(log_every_n_steps=50),
                GradStats(log_every_n_steps=50),
                ActivationStats(log_every_n_steps=50),
            ],
        ),
    }
    quiet_ms: dict[str, list[float]] = {name: [] for name in variants}
    logging_ms: dict[str, list[float]] = {name: [] for name in variants}
    breaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root, torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        for _ in range(args.repeats):
            for name, (compiled, callbacks) in variants.items():
                torch._dynamo.reset()
                counters.clear()
                times = fit(compiled, callbacks(), args.steps, root)
                breaks[name] = sum(counters["graph_break"].values())
                # Leave out the first 30 steps (compiles and early recompiles) and the first logging
                # step (the compile of the hooked graph).
                quiet_ms[name].append(statistics.median(t for s, t, _ in times if s > 30 and s % 50))
                logging_ms[name].append(statistics.median(t for s, t, _ in times if s > 50 and s % 50 == 0))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats x {args.steps} steps\n"
    )
    print("| variant | ms/step, steps that log nothing | ms/step, logging steps | graph breaks |")
    print("|---|---:|---:|---:|")
    for name in variants:
        q, lg = statistics.median(quiet_ms[name]), statistics.median(logging_ms[name])
        print(f"| {name} | {q * 1e3:.2f} | {lg * 1e3:.2f} | {breaks[name]} |")


if __name__ == "__main__":
    main()
