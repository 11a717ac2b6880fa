"""What each callback costs per training step, against the same Lightning fit without it.

    .venv/bin/python benchmarks/overhead.py                 # all workloads, about 10 minutes on 2 cores
    .venv/bin/python benchmarks/overhead.py --quick         # a smoke run, about a minute
    make bench                                              # the same as the first line

Workloads: the digits CNN, a small ``nn.TransformerEncoder`` language model on synthetic tokens,
and a ResNet-style CNN with about 25 modules. Each variant trains for a fixed number of steps in
this one process; variants run interleaved (A B C A B C ...) so that drifting machine load hits
all of them alike, and each figure is the median over repeats of the per-step figure inside one
fit. Ratios are to the Lightning fit with no callback, measured in the same run. Also reported:
host synchronisations (``Tensor.item``/``tolist``/``cpu``/``numpy``/``__bool__``/``__float__``
calls) that a variant adds per logging step, and each variant's peak resident memory, measured
in a fresh process per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger, TensorBoardLogger

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.digits import DigitsCNN, DigitsDataModule  # noqa: E402
from examples.resnet import DigitsResNet  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import ActivationStats, GradClamp, GradStats, NonFiniteGuard, ShapeLogger  # noqa: E402

CLAMP = 0.2

WORKLOADS: dict[str, Callable[[], tuple[pl.LightningModule, pl.LightningDataModule]]] = {
    "digits-cnn": lambda: (DigitsCNN(), DigitsDataModule(batch_size=64)),
    "transformer": lambda: (TinyTransformerLM(), TokenDataModule()),
    "resnet": lambda: (DigitsResNet(), DigitsDataModule(batch_size=64)),
}


@dataclass
class Variant:
    """One way of training: callbacks, Trainer options, logger."""

    name: str
    callbacks: Callable[[], list[pl.Callback]] = lambda: []
    trainer: dict[str, Any] = field(default_factory=dict)
    every: int = 50
    wandb: bool = False  # WandbLogger (offline) instead of TensorBoard
    watch: bool = False  # wandb.watch(model, log="all", log_freq=every)
    plain: bool = False  # a hand-written PyTorch loop, no Lightning


def variants(frequencies: list[int]) -> list[Variant]:
    found = [Variant("plain PyTorch loop", plain=True), Variant("lightning")]
    for every in frequencies:
        found += [
            Variant(f"ShapeLogger @{every}", lambda e=every: [ShapeLogger(log_every_n_steps=e)], every=every),
            Variant(f"GradClamp @{every}", lambda e=every: [GradClamp(CLAMP, log_every_n_steps=e)], every=every),
            Variant(f"GradStats @{every}", lambda e=every: [GradStats(log_every_n_steps=e)], every=every),
            Variant(f"ActivationStats @{every}", lambda e=every: [ActivationStats(log_every_n_steps=e)], every=every),
            Variant(f"NonFiniteGuard @{every}", lambda e=every: [NonFiniteGuard(check_every_n_steps=e)], every=every),
            Variant(f"all five @{every}", lambda e=every: all_five(e), every=every),
        ]
    found.append(Variant("gradient_clip_val", trainer={"gradient_clip_val": CLAMP, "gradient_clip_algorithm": "value"}))
    if _wandb_available():
        found += [Variant("wandb logger", wandb=True), Variant("wandb.watch(log='all') @50", wandb=True, watch=True)]
    return found


def all_five(every: int) -> list[pl.Callback]:
    return [
        ShapeLogger(log_every_n_steps=every),
        GradClamp(CLAMP, log_every_n_steps=every),
        GradStats(log_every_n_steps=every),
        ActivationStats(log_every_n_steps=every),
        NonFiniteGuard(check_every_n_steps=every),
    ]


def _wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


class StepTimer(pl.Callback):
    """Wall time of each training step, batch start to batch end, and host syncs inside it."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step, self._syncs = trainer.global_step, SYNCS.count
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append((self._step, time.perf_counter() - self._start, SYNCS.count - self._syncs))


class SyncCounter:
    """Counts calls that make the host wait for a tensor's value."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return original(tensor, *args, **kwargs)

            return counted

        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


SYNCS = SyncCounter()


def make_logger(variant: Variant, root: str, workload: str) -> Logger:
    if variant.wandb:
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(save_dir=root, offline=True, project="lightning-hooks-bench")
    return TensorBoardLogger(root, name=workload)


def run_once(workload: str, variant: Variant, steps: int, root: str) -> list[tuple[int, float, int]]:
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    if variant.plain:
        return plain_loop(model, data, steps)
    timer = StepTimer()
    logger = make_logger(variant, root, workload)
    if variant.watch:
        logger.watch(model, log="all", log_freq=variant.every)  # type: ignore[attr-defined]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=variant.every,
        logger=logger,
        callbacks=[*variant.callbacks(), timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **variant.trainer,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the shape table is printed once per fit
        trainer.fit(model, datamodule=data)
    if variant.wandb:
        import wandb

        wandb.finish()
    return timer.times


def plain_loop(model: pl.LightningModule, data: pl.LightningDataModule, steps: int) -> list[tuple[int, float, int]]:
    """The limit: the same model, data and optimizer in a hand-written loop."""
    data.setup("fit")
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    model.train()
    times: list[tuple[int, float, int]] = []
    step = 0
    while step < steps:
        for x, y in data.train_dataloader():
            start = time.perf_counter()
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten() if out.dim() > 2 else y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append((step, time.perf_counter() - start, 0))
            step += 1
            if step >= steps:
                break
    return times


def peak_rss_mb(workload: str, variant: str, steps: int) -> float:
    """Peak resident memory of one fit of ``variant`` in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory-probe", workload, variant, "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("WANDB_SILENT", "true")
    for name in ("lightning.pytorch", "lightning.fabric", "wandb"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of every figure")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--frequencies", nargs="*", type=int, default=[1, 10, 50])
    parser.add_argument("--quick", action="store_true", help="3 repeats, 60 steps, frequency 50 only, no memory")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--memory-probe", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.quick:
        args.repeats, args.steps, args.frequencies, args.no_memory = 3, 60, [50], True
    table = variants(args.frequencies)
    if args.memory_probe:
        workload, name = args.memory_probe
        with tempfile.TemporaryDirectory() as root:
            run_once(workload, next(v for v in table if v.name == name), args.steps, root)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return

    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"lightning {pl.__version__}, {torch.get_num_threads()} threads; {args.repeats} repeats x {args.steps} steps, "
        f"first {args.warmup} left out"
    )
    if not _wandb_available():
        print("wandb is not installed: the wandb.watch comparison is skipped (pip install 'lightning-hooks[bench]')")
    with tempfile.TemporaryDirectory() as root, SYNCS.counting():
        for workload in args.workloads:
            report(workload, table, args, root)


def report(workload: str, table: list[Variant], args: argparse.Namespace, root: str) -> None:
    every_step: dict[str, list[float]] = {v.name: [] for v in table}
    quiet_steps: dict[str, list[float]] = {v.name: [] for v in table}
    syncs: dict[str, list[float]] = {v.name: [] for v in table}
    for _ in range(args.repeats):
        for variant in table:
            times = [(s, t, n) for s, t, n in run_once(workload, variant, args.steps, root) if s >= args.warmup]
            every_step[variant.name].append(statistics.mean(t for _, t, _ in times))
            quiet = [t for s, t, _ in times if s % variant.every]  # none when every step logs
            quiet_steps[variant.name].append(statistics.median(quiet) if quiet else math.nan)
            logging_steps = [n for s, _, n in times if s % variant.every == 0]
            syncs[variant.name].append(statistics.median(logging_steps) if logging_steps else 0.0)
    base_all = statistics.median(every_step["lightning"])
    base_quiet = statistics.median(quiet_steps["lightning"])
    base_syncs = statistics.median(syncs["lightning"])
    memory = {}
    if not args.no_memory:
        for variant in table:
            if variant.every == 50:
                memory[variant.name] = peak_rss_mb(workload, variant.name, args.steps)
    print(f"\n### {workload}: {base_all * 1e3:.2f} ms per step in Lightning without callbacks\n")
    columns = ["variant", "ms/step", "× Lightning (all steps)", "× Lightning (steps that log nothing)"]
    columns += ["added host syncs per logging step", "peak RSS (MB)"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant in table:
        name = variant.name
        mean_all, quiet = statistics.median(every_step[name]), statistics.median(quiet_steps[name])
        added = "" if variant.plain else f"{statistics.median(syncs[name]) - base_syncs:+.0f}"
        rss = f"{memory[name]:.0f}" if name in memory else ""
        ratios = f"{mean_all / base_all:.3f} | " + ("—" if math.isnan(quiet) else f"{quiet / base_quiet:.3f}")
        print(f"| {name} | {mean_all * 1e3:.2f} | {ratios} | {added} | {rss} |")
    if "wandb.watch(log='all') @50" in every_step:
        ours = statistics.median(every_step["all five @50"]) - base_all
        theirs = statistics.median(every_step["wandb.watch(log='all') @50"]) - statistics.median(
            every_step["wandb logger"]
        )
        print(
            f"\nadded time per step at frequency 50: all five {ours * 1e3:+.3f} ms, wandb.watch {theirs * 1e3:+.3f} ms"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
