"""What MemoryLogger's recorded step costs against the same step unrecorded (public API only).

    .venv/bin/python benchmarks/memory_step.py              # the 24-layer encoder on CPU, ~1 min on 2 cores
    .venv/bin/python benchmarks/memory_step.py --steps 12 --layers 8 --batch 32

One fit with ``MemoryLogger(at_step=K)`` for each ``K`` in the recorded steps and one without it;
each step is timed from its ``on_train_batch_start`` to its ``on_train_batch_end``. The figure is the
recorded step over the median of the same fit's other steps after warm-up (the steps without hooks),
and, for the fit without the callback, its median step against the recorded fit's quiet steps.

The floors: one more fit runs step ``K`` under an empty ``TorchDispatchMode`` (each operator handed straight back to
torch), and one under that mode and torch's ``ModTracker`` (which ``MemTracker`` uses to know the running modules),
doing nothing with what they see. Any tracker that sees every operator from Python costs at least the first; torch's
``MemTracker``, built on both, at least the second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.encoder import EncoderLM  # noqa: E402
from examples.transformer import TokenDataModule  # noqa: E402
from lightning_hooks import MemoryLogger  # noqa: E402


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times[trainer.global_step - 1] = time.perf_counter() - self._start


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class EmptyMode(pl.Callback):
    """Runs step ``at_step`` under :class:`Passthrough` (and torch's ``ModTracker`` with ``modules``), from its batch
    start to its batch end."""

    def __init__(self, at_step: int, modules: bool) -> None:
        self.at_step = at_step
        self.contexts: list[Any] = [ModTracker(), Passthrough()] if modules else [Passthrough()]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            for context in self.contexts:
                context.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step - 1 == self.at_step:
            for context in reversed(self.contexts):
                context.__exit__(None, None, None)


def fit(args: argparse.Namespace, at_step: int | None, floor: str = "") -> dict[int, float]:
    torch.manual_seed(0)
    timer = StepTimer()
    callbacks: list[pl.Callback] = []
    if at_step is not None:
        callbacks.append(EmptyMode(at_step, floor == "modules") if floor else MemoryLogger(at_step=at_step))
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root,
            accelerator="cpu",
            max_steps=args.steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[*callbacks, timer],  # the timer's batch end runs after MemoryLogger's table
        )
        data = TokenDataModule(seq_len=args.seq_len, n=args.batch * args.steps, batch_size=args.batch)
        trainer.fit(EncoderLM(layers=args.layers, seq_len=args.seq_len), datamodule=data)
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--at", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    plain = fit(args, None)
    quiet_plain = statistics.median(t for s, t in plain.items() if s >= 2)
    print(f"EncoderLM(layers={args.layers}), batch {args.batch}x{args.seq_len}, CPU, {torch.get_num_threads()} threads")
    print(f"fit without MemoryLogger: median step {1000 * quiet_plain:.1f} ms")
    first = args.at[0]
    for floor, what in [("dispatch", "an empty dispatch mode"), ("modules", "that and torch's ModTracker")]:
        times = fit(args, first, floor=floor)
        quiet = statistics.median(t for s, t in times.items() if s >= 2 and s != first)
        print(f"{what} at step {first}: {1000 * times[first]:.1f} ms = {times[first] / quiet:.2f}x")
    for at in args.at:
        times = fit(args, at)
        quiet = statistics.median(t for s, t in times.items() if s >= 2 and s != at)
        print(
            f"MemoryLogger(at_step={at}): recorded step {1000 * times[at]:.1f} ms = {times[at] / quiet:.2f}x its "
            f"fit's median other step ({1000 * quiet:.1f} ms, {quiet / quiet_plain:.2f}x the fit without it)"
        )


if __name__ == "__main__":
    main()
