"""How many torch operators the callbacks dispatch per step: on a GPU each one that is not a view is a kernel launch,
and GPT-2 small's step there is bound by the host (docs/performance.md, "On a GPU"), so this count, which needs no GPU
and repeats exactly, is what a logging step's extra time on a GPU follows.

    .venv/bin/python benchmarks/dispatches.py [--variants "all six" observers ...]

The model is ``benchmarks/gpu.py``'s GPT-2 small (12 layers, hidden 768, vocabulary 50,257) with a sequence of 64
and a batch of 1, so that a CPU runs a step in a second; its tensors are as many, and as many of them as large, as
on the GPU. Each variant runs 11 steps logging every 5; the table gives the operators of a quiet step (6) and of a
logging step (5), those of them that are views (no kernel), and the most frequent ones a logging step adds.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import GPT2, SIZES, all_six, observers  # noqa: E402
from lightning_hooks import ActivationStats, GradStats, HealthMonitor  # noqa: E402

SIZES["dispatch"] = {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq": 64, "batch": 1, "vocab": 50257}
VARIANTS: dict[str, Callable[[], list[pl.Callback]]] = {
    "without callbacks": list,
    "all six": all_six,
    "observers": observers,
    "GradStats + ActivationStats": lambda: [GradStats(), ActivationStats()],
    "HealthMonitor": lambda: [HealthMonitor()],
}


class Dispatches(TorchDispatchMode):
    """Counts the operators dispatched while it is held, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class PerStep:
    """Two callbacks that hold a :class:`Dispatches` from the first one's batch start to the last one's batch end."""

    def __init__(self) -> None:
        self.steps: dict[int, collections.Counter[str]] = {}
        self.mode, self.step = Dispatches(), 0
        meter = self

        class First(pl.Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
                meter.mode, meter.step = Dispatches(), trainer.global_step
                meter.mode.__enter__()

        class Last(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                meter.mode.__exit__(None, None, None)
                meter.steps[meter.step] = meter.mode.counts

        self.first, self.last = First(), Last()


def views(counts: collections.Counter[str]) -> int:
    return sum(n for name, n in counts.items() if name.split(".")[0] in VIEWS)


VIEWS = {"detach", "view", "unsqueeze", "slice", "select", "reshape", "alias", "t", "transpose", "expand", "split"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print("| variant | quiet step: operators (views) | logging step: operators (views) | most added by logging |")
    print("|---|---:|---:|---|")
    for name in args.variants:
        torch.manual_seed(0)
        meter = PerStep()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=11,
            log_every_n_steps=5,
            logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp(), name=""),
            callbacks=[meter.first, *VARIANTS[name](), meter.last],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(GPT2("dispatch", compiled=False))
        quiet, logging_step = meter.steps[6], meter.steps[5]
        added = ", ".join(f"{op} {n}" for op, n in (logging_step - quiet).most_common(6))
        print(
            f"| {name} | {sum(quiet.values())} ({views(quiet)}) | {sum(logging_step.values())} "
            f"({views(logging_step)}) | {added} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
