"""What each callback costs per training step, against the same Lightning fit without it.

    .venv/bin/python benchmarks/overhead.py                    # wall time, all workloads, ~15 min on 2 cores
    .venv/bin/python benchmarks/overhead.py --quick            # a smoke run, about a minute
    .venv/bin/python benchmarks/overhead.py --instructions 10  # instruction counts (valgrind), 25-50 min
    make bench / make bench-instructions                       # the first / the third line

Workloads: the digits CNN, a small ``nn.TransformerEncoder`` language model on synthetic tokens,
a ResNet-style CNN with 28 modules, and (``--workloads encoder24``, not run by default) a
24-layer encoder with 486 parameter tensors and 342 modules. Variants: a hand-written PyTorch
loop (the limit), the Lightning fit without callbacks, each callback alone, all five together and
``GradStats`` + ``ActivationStats`` together at each logging frequency, ``HealthMonitor`` with
every check and without ``loss_spike`` (the one check that keeps something on every step), an
empty ``Callback`` (what Lightning charges any callback), ``gradient_clip_val`` (value clipping),
torch's multi-tensor clamp alone (the floor under ``GradClamp``), plain torch hooks that copy every output and
output gradient and reduce the copies (:class:`Floor`: a peer of the statistics pair), and wandb's logger with and
without ``wandb.watch(log="all")`` (offline).

Two measures:

* **Wall time.** Each fit runs in a fresh fork of this process (same imports, no earlier fit's
  garbage or thread pools), variants in an order rotated every repeat so that no variant always
  follows the same one; a step is timed from its ``on_train_batch_start`` to the next one's (so
  callbacks' set-up and Lightning's logging count), the first ``--warmup`` steps left out.
  Figures are medians over repeats of each fit's mean step and of its median and 10th
  percentile quiet step; a second run of the baseline shows the machine's noise. Also: host
  synchronisations (``Tensor.item``/``tolist``/``cpu``/``numpy``/``__bool__``/... calls) a variant
  adds per logging step, and peak resident memory from a fresh process per variant.
* **Instructions** (``--instructions N``): every variant runs once under valgrind's callgrind
  with one intra-op thread, logging every ``N`` steps, and steps ``N`` to ``2N - 1`` are counted
  one by one (see ``_callgrind.py``). The counts repeat to 0.05 % whatever else the machine
  does, so ratios of 1.01 are resolved where wall time on a shared VM scatters by 15 %. The
  window holds one logging step of each kind; ratios for logging every 50 steps extend it with
  quiet steps. Instructions are not time: a SIMD kernel does more work per instruction than the
  interpreter, so Python-heavy overhead costs relatively more time than its share of
  instructions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import pickle
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
from examples.encoder import EncoderLM  # noqa: E402
from examples.resnet import DigitsResNet  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import (  # noqa: E402
    ActivationStats,
    GradClamp,
    GradStats,
    HealthMonitor,
    MemoryLogger,
    NonFiniteGuard,
    ShapeLogger,
)

CHECKS = tuple(HealthMonitor().checks)
"""Every check ``HealthMonitor`` runs, in its order (``checks=None`` is all of them)."""
QUIET_CHECKS = [c for c in CHECKS if c != "loss_spike"]
"""Every check but the one that keeps something on every step."""

CLAMP = 0.2

WORKLOADS: dict[str, Callable[[], tuple[pl.LightningModule, pl.LightningDataModule]]] = {
    "digits-cnn": lambda: (DigitsCNN(), DigitsDataModule(batch_size=64)),
    "transformer": lambda: (TinyTransformerLM(), TokenDataModule()),
    "resnet": lambda: (DigitsResNet(), DigitsDataModule(batch_size=64)),
    # 24 layers, 486 parameter tensors, 342 modules (benchmarks/logging_step.py times its logging step)
    "encoder24": lambda: (EncoderLM(), TokenDataModule(seq_len=16, batch_size=16)),
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
    """Every variant at every frequency; the Trainer logs at the same frequency as the callbacks."""
    found = [Variant("plain PyTorch loop", plain=True, every=max(frequencies))]
    for every in frequencies:
        found += [
            Variant(baseline(every), every=every),
            Variant(f"ShapeLogger @{every}", lambda e=every: [ShapeLogger(log_every_n_steps=e)], every=every),
            Variant(f"GradClamp @{every}", lambda e=every: [GradClamp(CLAMP, log_every_n_steps=e)], every=every),
            Variant(f"GradStats @{every}", lambda e=every: [GradStats(log_every_n_steps=e)], every=every),
            Variant(f"ActivationStats @{every}", lambda e=every: [ActivationStats(log_every_n_steps=e)], every=every),
            Variant(f"NonFiniteGuard @{every}", lambda e=every: [NonFiniteGuard(check_every_n_steps=e)], every=every),
            Variant(f"all five @{every}", lambda e=every: all_five(e), every=every),
            Variant(f"GradStats + ActivationStats @{every}", lambda e=every: statistics_pair(e), every=every),
            Variant(f"HealthMonitor @{every}", lambda e=every: [HealthMonitor(log_every_n_steps=e)], every=every),
            Variant(
                f"HealthMonitor without loss_spike @{every}",
                lambda e=every: [HealthMonitor(log_every_n_steps=e, checks=QUIET_CHECKS)],  # type: ignore[arg-type]
                every=every,
            ),
        ]
    every = max(frequencies)
    found.append(Variant(f"an empty Callback @{every}", lambda: [pl.Callback()], every=every))
    # Step 1 lies before every measured window: what the fit pays on the steps MemoryLogger does not record.
    found.append(Variant(f"MemoryLogger(at_step=1) @{every}", lambda: [MemoryLogger(at_step=1)], every=every))
    found.append(Variant(f"all five, figures=False @{every}", lambda: all_five(every, figures=False), every=every))
    clip = {"gradient_clip_val": CLAMP, "gradient_clip_algorithm": "value"}
    found.append(Variant(f"gradient_clip_val @{every}", trainer=clip, every=every))
    found.append(Variant(f"torch's foreach clamp alone @{every}", lambda: [ForeachClamp()], every=every))
    # The plainest way to take statistics of every output and output gradient safely: a peer of the statistics pair.
    found.append(Variant(f"plain hooks + copies @{every}", lambda: [Floor(every, "copies")], every=every))
    if _wandb_available():
        found += [
            Variant(f"wandb logger @{every}", wandb=True, every=every),
            Variant(f"wandb.watch(log='all') @{every}", wandb=True, watch=True, every=every),
        ]
    return found


def baseline(every: int) -> str:
    """The name of the Lightning fit without callbacks that logs every ``every`` steps."""
    return f"lightning @{every}"


def all_five(every: int, figures: bool = True) -> list[pl.Callback]:
    return [
        ShapeLogger(log_every_n_steps=every),
        GradClamp(CLAMP, log_every_n_steps=every),
        GradStats(log_every_n_steps=every, figures=figures),
        ActivationStats(log_every_n_steps=every, figures=figures),
        NonFiniteGuard(check_every_n_steps=every),
    ]


def statistics_pair(every: int) -> list[pl.Callback]:
    """The two statistics callbacks together: what ``benchmarks/logging_step.py`` times on its own."""
    return [GradStats(log_every_n_steps=every), ActivationStats(log_every_n_steps=every)]


class ForeachClamp(pl.Callback):
    """The least clamping every gradient costs: torch's two multi-tensor clamps before each optimizer step, with no
    gate, no count of clamped values and no logging (what ``GradClamp`` runs underneath). On CPU each of the two
    loops over the tensors, one kernel per tensor: a floor that grows with the count of parameter tensors."""

    def __init__(self) -> None:
        self.params: list[torch.nn.Parameter] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = list(pl_module.parameters())  # once: walking 342 modules costs more than the clamps

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        grads = [grad for p in self.params if (grad := p.grad) is not None]
        torch._foreach_clamp_min_(grads, -CLAMP)
        torch._foreach_clamp_max_(grads, CLAMP)


class Floor(pl.Callback):
    """Plain torch hooks on every module on logging steps, removed at the step's end: with ``kind`` ``"hooks"`` they do
    nothing, ``"sums"`` takes one sum of each output and output gradient, ``"copies"`` copies each and reduces the
    copies of each shape at the step's end to four plain statistics (sum, sum of squares, largest magnitude, non-zero
    count); one transfer. The peers ``benchmarks/logging_step.py --floor`` and the ``plain hooks + copies`` variant
    measure the callbacks against."""

    def __init__(self, every: int, kind: str) -> None:
        self.every, self.kind = every, kind
        self.modules: list[torch.nn.Module] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.taken: list[torch.Tensor] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.modules = list(pl_module.modules())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.handles = [module.register_forward_hook(self.output) for module in self.modules]

    def output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.take(output)
            if output.requires_grad:
                output.register_hook(self.gradient)

    def gradient(self, grad: torch.Tensor) -> None:
        self.take(grad)

    def take(self, t: torch.Tensor) -> None:
        if self.kind == "sums":
            self.taken.append(t.detach().sum())
        elif self.kind == "copies":
            self.taken.append(t.detach().clone())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if not self.taken:
            return
        if self.kind == "copies":
            by_shape: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
            for t in self.taken:
                by_shape.setdefault((t.shape, t.dtype), []).append(t.reshape(-1))
            reduced = []
            for rows in by_shape.values():
                m = torch.stack(rows).float()
                reduced += [m.sum(1), m.square().sum(1), m.abs().amax(1), (m != 0).sum(1).float()]
            self.taken = reduced
        torch.cat([t.reshape(-1).float() for t in self.taken]).tolist()
        self.taken = []


def _wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


class StepProbe(pl.Callback):
    """Measures each training step from its ``on_train_batch_start`` to the next one's.

    Put first in the callback list, a step's figure covers every other callback's hooks for that
    step, the optimizer step, Lightning's logging and the fetch of the next batch: what a whole
    fit spends per step. ``measure`` and ``finish`` are called by the plain loop directly.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, int]] = []  # (step, figure, host syncs)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.measure(trainer.global_step)

    def measure(self, step: int) -> None:
        raise NotImplementedError


class StepTimer(StepProbe):
    """Wall time of each step, and the host syncs inside it."""

    def measure(self, step: int) -> None:
        now, syncs = time.perf_counter(), SYNCS.count
        if step > 0:
            self.steps.append((step - 1, now - self._start, syncs - self._syncs))
        self._start, self._syncs = now, syncs


class StepInstructions(StepProbe):
    """Instructions executed by each step in ``[first, first + count)``, counted by callgrind."""

    def __init__(self, first: int, count: int) -> None:
        from benchmarks._callgrind import InstructionMeter

        super().__init__()
        self.first, self.end = first, first + count
        self._meter = InstructionMeter()

    def measure(self, step: int) -> None:
        if self.first < step <= self.end:
            self._meter.mark(f"step {step - 1}")
        if step == self.first:
            # Every window starts from a collected, frozen heap: the collections counted in it are
            # the variant's own, not an accident of what the variants before it left behind.
            gc.collect()
            gc.freeze()
            self._meter.start()
        elif step == self.end:
            self._meter.stop()
            counts = self._meter.collect()
            self.steps = [(self.first + i, float(n), 0) for i, n in enumerate(counts)]


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


def run_once(workload: str, variant: Variant, steps: int, root: str, probe: StepProbe) -> list[tuple[int, float, int]]:
    """Train ``variant`` for ``steps`` measured steps (one more runs to close the last one)."""
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    if variant.plain:
        plain_loop(model, data, steps + 1, probe)
        return probe.steps
    logger = make_logger(variant, root, workload)
    if variant.watch:
        logger.watch(model, log="all", log_freq=variant.every)  # type: ignore[attr-defined]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps + 1,
        log_every_n_steps=variant.every,
        logger=logger,
        callbacks=[probe, *variant.callbacks()],
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
    return probe.steps


def plain_loop(model: pl.LightningModule, data: pl.LightningDataModule, steps: int, probe: StepProbe) -> None:
    """The limit: the same model, data and optimizer in a hand-written loop."""
    data.setup("fit")
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    model.train()
    step = 0
    while step < steps:
        for x, y in data.train_dataloader():
            probe.measure(step)
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten() if out.dim() > 2 else y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step >= steps:
                break


def in_fork(work: Callable[[], Any]) -> Any:
    """Run ``work`` in a forked child and return its result.

    Each fit starts from the same state of the interpreter (imports done, no earlier fit's
    garbage, allocator or thread pools), so a variant's place in the run order cannot favour it.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        status = 0
        try:
            payload = pickle.dumps(("ok", work()))
        except BaseException as error:  # report anything, then leave without running the parent's cleanup
            payload, status = pickle.dumps(("error", repr(error))), 1
        with os.fdopen(write, "wb") as out:
            out.write(payload)
        os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        kind, value = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    if kind == "error":
        raise RuntimeError(f"a benchmark fit failed: {value}")
    return value


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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of every figure")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS)[:3], choices=list(WORKLOADS))
    parser.add_argument("--frequencies", nargs="*", type=int, default=[1, 10, 50])
    parser.add_argument("--quick", action="store_true", help="3 repeats, 60 steps, frequency 50 only, no memory")
    parser.add_argument("--only", nargs="*", metavar="VARIANT", help="run only these variants (and the baselines)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--instructions",
        type=int,
        metavar="N",
        help="count instructions under valgrind's callgrind instead of timing: every variant logs every N steps "
        "and steps N to 2N-1 are counted (see the docstring)",
    )
    parser.add_argument("--memory-probe", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--count-child", nargs=2, metavar=("WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.quick:
        args.repeats, args.steps, args.frequencies, args.no_memory = 3, 60, [50], True
    if args.instructions is not None:
        args.frequencies = [args.instructions]
    table = variants(args.frequencies)
    if args.only:
        table = [v for v in table if v.name in args.only or v.name.startswith("lightning @")]
    if args.memory_probe:
        workload, name = args.memory_probe
        with tempfile.TemporaryDirectory() as root:
            run_once(workload, next(v for v in table if v.name == name), args.steps, root, StepTimer())
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return
    if args.count_child:
        count_child(*args.count_child, table, args.instructions)
        return
    if not _wandb_available():
        print("wandb is not installed: the wandb.watch comparison is skipped (pip install 'lightning-hooks[bench]')")
    if args.instructions is not None:
        count_instructions(table, args)
        return
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"lightning {pl.__version__}, {torch.get_num_threads()} threads; {args.repeats} repeats x {args.steps} steps "
        f"per variant, each fit in a fresh fork, run order rotated per repeat, first {args.warmup} steps left out"
    )
    with tempfile.TemporaryDirectory() as root, SYNCS.counting():
        for workload in args.workloads:
            report(workload, table, args, root)


def summarise(steps: list[tuple[int, float, int]], every: int, warmup: int) -> tuple[float, float, float, float]:
    """Of one fit: mean time per step; median and 10th percentile of the steps that log nothing;
    median host syncs per logging step.

    The 10th percentile is the time of an undisturbed step: on a shared machine interruptions only
    ever add time, so the fastest steps of a fit are the ones that show what the code costs.
    """
    kept = [(s, t, n) for s, t, n in steps if s >= warmup]
    quiet = [t for s, t, _ in kept if s % every]  # none when every step logs
    syncs = [n for s, _, n in kept if s % every == 0]
    return (
        statistics.mean(t for _, t, _ in kept),
        statistics.median(quiet) if quiet else math.nan,
        statistics.quantiles(quiet, n=10)[0] if len(quiet) > 1 else math.nan,
        statistics.median(syncs) if syncs else 0.0,
    )


def report(workload: str, table: list[Variant], args: argparse.Namespace, root: str) -> None:
    names = [v.name for v in table] + [f"{baseline(max(args.frequencies))}, again"]
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            variant = find(table, name)
            steps = in_fork(lambda v=variant: run_once(workload, v, args.steps, root, StepTimer()))
            runs[name].append(summarise(steps, variant.every, args.warmup))

    def median(name: str, column: int) -> float:
        return statistics.median(run[column] for run in runs[name])

    memory = {}
    if not args.no_memory:
        for variant in table:
            if variant.every == max(args.frequencies):
                memory[variant.name] = peak_rss_mb(workload, variant.name, args.steps)
    reference = baseline(max(args.frequencies))
    print(f"\n### {workload}: {median(reference, 0) * 1e3:.2f} ms per step in Lightning without callbacks\n")
    columns = ["variant", "ms/step", "× Lightning (all steps)", "× Lightning (steps that log nothing)"]
    columns += ["× Lightning (fastest 10 % of those)", "added host syncs per logging step", "peak RSS (MB)"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        variant = find(table, name)
        base = baseline(variant.every)
        ratios = [median(name, column) / median(base, column) for column in (0, 1, 2)]
        text = " | ".join("—" if math.isnan(r) else f"{r:.3f}" for r in ratios)
        added = "" if variant.plain else f"{median(name, 3) - median(base, 3):+.0f}"
        rss = f"{memory[name]:.0f}" if name in memory else ""
        print(f"| {name} | {median(name, 0) * 1e3:.2f} | {text} | {added} | {rss} |")
    every = max(args.frequencies)
    watch, logger = f"wandb.watch(log='all') @{every}", f"wandb logger @{every}"
    if watch in runs:
        ours = median(f"all five @{every}", 0) - median(reference, 0)
        theirs = median(watch, 0) - median(logger, 0)
        print(
            f"\nadded time per step at frequency {every}: "
            f"all five {ours * 1e3:+.3f} ms, wandb.watch {theirs * 1e3:+.3f} ms"
        )
    sys.stdout.flush()


def find(table: list[Variant], name: str) -> Variant:
    """The variant called ``name``; ``"<baseline>, again"`` is a second, independent run of that baseline."""
    if name.endswith(", again"):
        return find(table, name.removesuffix(", again"))
    return next(v for v in table if v.name == name)


def count_child(workload: str, out: str, table: list[Variant], every: int) -> None:
    """Under callgrind: each variant once, steps ``every`` to ``2 * every - 1`` counted."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        for name in [v.name for v in table] + [f"{baseline(every)}, again"]:
            probe = StepInstructions(every, every)
            steps = run_once(workload, find(table, name), 2 * every, root, probe)
            with open(out, "a") as file:
                file.write(json.dumps({"variant": name, "steps": [[s, n] for s, n, _ in steps]}) + "\n")


def count_instructions(table: list[Variant], args: argparse.Namespace) -> None:
    """One callgrind process per workload, run side by side: instruction counts ignore the load."""
    from benchmarks import _callgrind

    _callgrind.require()
    every = args.instructions
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, torch {torch.__version__}, lightning {pl.__version__}, "
        f"valgrind's callgrind, 1 thread; every variant logs every {every} steps, steps {every}-{2 * every - 1} "
        "counted, one run per variant"
    )
    sys.stdout.flush()
    with _callgrind.workspace() as (out_dir, library):
        children = {}
        for workload in args.workloads:
            out, log = out_dir / f"{workload}.jsonl", out_dir / f"{workload}.log"
            python = [sys.executable, __file__, "--count-child", workload, str(out), "--instructions", str(every)]
            python += ["--only", *args.only] if args.only else []
            children[workload] = (_callgrind.start(python, out_dir, library, log), out, log)
        for workload, (child, out, log) in children.items():
            if child.wait() != 0:
                sys.exit(f"{workload}: the counting process failed:\n{log.read_text()[-3000:]}")
            counts = {}
            for line in out.read_text().splitlines():
                row = json.loads(line)
                counts[row["variant"]] = {step: n for step, n in row["steps"]}
            report_instructions(workload, table, counts, every)


def projected(steps: dict[int, float], every: int, period: int) -> float:
    """Instructions per step over ``period`` steps, from one counted period of ``every`` steps.

    The counted window holds exactly one logging step of each kind (the callbacks' and
    Lightning's); the other ``period - every`` steps of the longer period are quiet steps,
    taken at the median of the window's quiet ones.
    """
    quiet = statistics.median(n for s, n in steps.items() if s % every and (s + 1) % every)
    return (sum(steps.values()) + (period - every) * quiet) / period


def report_instructions(workload: str, table: list[Variant], counts: dict[str, dict[int, float]], every: int) -> None:
    reference = counts[baseline(every)]
    again = sum(counts[f"{baseline(every)}, again"].values()) / sum(reference.values())
    print(
        f"\n### {workload}: {sum(reference.values()) / every / 1e6:.1f} M instructions per step in Lightning "
        f"without callbacks (a second run of it: {again:.5f}×)\n"
    )
    periods = sorted({every, 50})
    heads = " | ".join(f"× Lightning @{p} (all steps)" for p in periods)
    print(
        f"| variant | M instructions per quiet step | × Lightning (steps that log nothing) "
        f"| M instructions, the callbacks' logging step (step {every}) | {heads} |"
    )
    print("|---|---:|---:|---:|" + "---:|" * len(periods))
    base = {p: projected(reference, every, p) for p in periods}
    base_quiet = statistics.median(n for s, n in reference.items() if s % every and (s + 1) % every)
    for name, steps in counts.items():
        quiet = statistics.median(n for s, n in steps.items() if s % every and (s + 1) % every)
        ratios = " | ".join(f"{projected(steps, every, p) / base[p]:.4f}" for p in periods)
        print(f"| {name} | {quiet / 1e6:.2f} | {quiet / base_quiet:.4f} | {steps[every] / 1e6:.2f} | {ratios} |")
    watch, logger = f"wandb.watch(log='all') @{every}", f"wandb logger @{every}"
    if watch in counts:
        for p in periods:
            ours = projected(counts[f"all five @{every}"], every, p) - base[p]
            theirs = projected(counts[watch], every, p) - projected(counts[logger], every, p)
            print(
                f"added per step, logging every {p}: "
                f"all five {ours / 1e6:+.3f} M instructions, wandb.watch {theirs / 1e6:+.3f} M"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
