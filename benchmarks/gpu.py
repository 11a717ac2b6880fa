"""What the callbacks cost on one GPU, where users train: a GPT-2-small-sized model, eager and compiled.

    python benchmarks/gpu.py [--out DIR] [--budget SECONDS]   # on a machine with a CUDA GPU, ~6 minutes
    python benchmarks/gpu.py --smoke                          # a tiny model on the CPU: checks the script runs
    bash benchmarks/gpu.sh                                    # what a lent GPU machine runs: `pytest -m cuda`, this

The model is ``transformers``' GPT-2 built from a config with random weights (12 layers, hidden 768,
sequence 512, batch 8 of random tokens), trained with AdamW under ``precision="bf16-mixed"``, once
as it is (eager) and once with ``torch.compile`` on it inside the LightningModule. Sections, each
written to ``gpu.json`` as soon as it ends (a run cut short keeps what it measured):

1. **Step time** (``time``). Fits without callbacks, with all six at ``log_every_n_steps=50``, with the four
   observers (ShapeLogger, GradStats, ActivationStats, HealthMonitor) and with NonFiniteGuard alone, checking
   every step and every 10 steps. Each fit leaves out its first ``WARMUP`` steps (compiles) and times windows of
   50 steps (each holds one logging step) between two synchronisations; the figure is the median window over
   every fit of a variant, relative to the baseline's. Fits run in rounds, every variant once per round in an
   order rotated every round, until the budget's share for the section is spent. Peak memory
   (``torch.cuda.max_memory_allocated`` from the fit's start) comes from the same fits, and compiled, dynamo's
   graphs and graph breaks of each fit.
2. **The logging step's extra time** (``logging``): fits logging every 10 steps, synchronised at every
   step, without callbacks, with all six, GradStats with ActivationStats, and HealthMonitor: the median
   logging step less the median quiet step (a quiet step's cost shows against the fit without callbacks),
   and each fit's peak memory. Eager, all six and the statistics pair also run with a prototype,
   ``SlabsOnDevice``: large tensors copied into slabs and reduced several at once.
3. **MemoryLogger** (``memory_logger``): its peak of the recorded step against
   ``torch.cuda.max_memory_allocated`` over the same step, and the recorded step's time, with its floors: the
   same step under an empty dispatch mode, and under that and torch's ``ModTracker``.
4. **Synchronisations** (``sync``): ``torch.cuda.set_sync_debug_mode("warn")`` over the quiet steps of fits
   without callbacks, with every callback but NonFiniteGuard and with NonFiniteGuard alone (its one flag
   read a step expected), counting what each warns of; then, where the fit without callbacks synchronised
   nowhere, every callback but NonFiniteGuard under ``"error"``.
5. **Memory tools** (``memory``): the cost of recording the allocator's history while training
   (``torch.cuda.memory._record_memory_history``: torch's defaults, ``MemoryLogger(snapshot_on_oom=True)``'s
   setting, and the events without stacks) against the same fit without; a snapshot written after a step
   made to run out of memory; and torch's ``MemTracker`` peak for one step against
   ``torch.cuda.max_memory_allocated``.
6. **Where a logging step's host time goes** (``profile``): cProfile over two logging steps of all six,
   eager, into ``profile.txt``.

``--modes`` and ``--sections`` pick what runs, the modes in the order given (eager first by default);
``--variants`` picks the step-time fits, among them four of parts of all six (``SINGLES``: GradClamp,
HealthMonitor, ShapeLogger, the statistics pair), timed only when named. Each fit prints its name as it
starts and its seconds as it ends, and ``--stacks-after`` prints every thread's stack every that many
seconds (``gpu.sh``: every 100 s), so a run cut short says where it was.

Figures go to ``docs/performance.md`` with the card and the date, never into docstrings.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import faulthandler
import gc
import io
import json
import logging
import math
import os
import pickle
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.optim import Optimizer
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_hooks import (  # noqa: E402
    ActivationStats,
    GradClamp,
    GradStats,
    HealthMonitor,
    NonFiniteGuard,
    ShapeLogger,
)

SIZES: dict[str, dict[str, int]] = {
    "gpt2-small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq": 512, "batch": 8, "vocab": 50257},
    "smoke": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq": 16, "batch": 4, "vocab": 256},
    "proxy": {"n_layer": 12, "n_embd": 64, "n_head": 4, "seq": 32, "batch": 8, "vocab": 1024},
}
EVERY = 50
WARMUP = 10
SECTIONS = ("time", "logging", "memory_logger", "memory", "sync", "profile")


class GPT2(pl.LightningModule):
    """GPT-2 from a config (random weights) on random tokens; ``compiled`` wraps it in ``torch.compile``."""

    def __init__(self, size: str, compiled: bool) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        s = SIZES[size]
        config = GPT2Config(
            n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"], n_positions=s["seq"], vocab_size=s["vocab"]
        )
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # named: transformers' warning that it is not breaks the compiled graph in two
        self.model = torch.compile(model) if compiled else model
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, s["vocab"], (32 * s["batch"], s["seq"]), generator=generator)
        self.batch_size = s["batch"]
        self.oom_at: int | None = None
        self.fused = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.oom_at is not None and self.global_step == self.oom_at:
            torch.empty(1 << 50, dtype=torch.uint8, device=batch.device)  # a petabyte: out of memory
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.fused or None)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens, batch_size=self.batch_size, shuffle=True, drop_last=True)  # type: ignore[arg-type]


def all_six() -> list[pl.Callback]:
    return [ShapeLogger(), GradStats(), ActivationStats(), GradClamp(1.0), NonFiniteGuard(), HealthMonitor()]


def observers() -> list[pl.Callback]:
    return [ShapeLogger(), GradStats(), ActivationStats(), HealthMonitor()]


VARIANTS: dict[str, Callable[[], list[pl.Callback]]] = {
    "without callbacks": list,
    "all six @50": all_six,
    "observers @50": observers,
    "NonFiniteGuard": lambda: [NonFiniteGuard()],
    "NonFiniteGuard every 10": lambda: [NonFiniteGuard(check_every_n_steps=10)],
}


class FusedAdamW(pl.Callback):
    """Trains the fit with ``AdamW(fused=True)``, which skips a step on the device when handed a flag: there
    NonFiniteGuard reads its flag a step later instead of waiting for it."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.fused = True  # type: ignore[assignment]  # before Lightning calls configure_optimizers

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.fused = False  # type: ignore[assignment]


SINGLES: dict[str, Callable[[], list[pl.Callback]]] = {
    "without callbacks, fused AdamW": lambda: [FusedAdamW()],
    "NonFiniteGuard, fused AdamW": lambda: [FusedAdamW(), NonFiniteGuard()],
    "all six @50, fused AdamW": lambda: [FusedAdamW(), *all_six()],
    "GradClamp": lambda: [GradClamp(1.0)],
    "HealthMonitor @50": lambda: [HealthMonitor()],
    "ShapeLogger @50": lambda: [ShapeLogger()],
    "GradStats + ActivationStats @50": lambda: [GradStats(), ActivationStats()],
}
"""Fits timed only when ``--variants`` names them: what each part of all six adds (run 9's compiled 1.53×), and the
guard with a fused optimizer (no read a step: against the fused fit without callbacks)."""
TIMED = {**VARIANTS, **SINGLES}


class SlabsOnDevice(pl.Callback):
    """A prototype, timed beside the library as it is: a tensor of up to ``CHUNK`` values copied into its shape's
    slab (``slab_mb`` each, at most ``open_slabs`` filled at once) and reduced with the slab's other rows, instead of
    reduced alone in about twelve operators. On a GPU the copy is one launch and the host pays per operator, not per
    value; on a CPU the library keeps slabs of 1 MB for rows of at most 32 K values, which the cache holds. It sets
    ``lightning_hooks.stats.batch``'s limits for the fit and puts them back after it."""

    def __init__(self, slab_mb: int = 64, open_slabs: int = 4) -> None:
        from lightning_hooks.stats.state import CHUNK

        self.limits = {"ROW_MAX": CHUNK, "SLAB_BYTES": slab_mb << 20, "SLABS_OPEN": open_slabs}
        self.saved: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_hooks.stats import batch

        self.saved = {name: getattr(batch, name) for name in self.limits}
        for name, value in self.limits.items():
            setattr(batch, name, value)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_hooks.stats import batch

        for name, value in self.saved.items():
            setattr(batch, name, value)


LOGGING_VARIANTS: dict[str, Callable[[], list[pl.Callback]]] = {
    "without callbacks": list,
    "all six": all_six,
    "GradStats + ActivationStats": lambda: [GradStats(), ActivationStats()],
    "HealthMonitor": lambda: [HealthMonitor()],
    "all six, slabs on the device (prototype)": lambda: [SlabsOnDevice(), *all_six()],
    "GradStats + ActivationStats, slabs on the device (prototype)": lambda: [
        SlabsOnDevice(),
        GradStats(),
        ActivationStats(),
    ],
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock(pl.Callback):
    """Marks the host clock, after a synchronisation, at the start of every ``window``-th step from ``warmup`` (every
    step when ``window`` is 1) and at the end of training; keeps the peak allocated memory of the fit."""

    def __init__(self, warmup: int, window: int) -> None:
        self.warmup, self.window = warmup, window
        self.marks: list[tuple[int, float]] = []
        self.peak = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step >= self.warmup and (step - self.warmup) % self.window == 0:
            sync()
            self.marks.append((step, time.perf_counter()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync()
        self.marks.append((trainer.global_step, time.perf_counter()))
        if torch.cuda.is_available():
            self.peak = torch.cuda.max_memory_allocated()

    def step_ms(self) -> list[tuple[int, float]]:
        """(first step, ms per step) of each window."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        return [(a, 1e3 * (tb - ta) / (b - a)) for (a, ta), (b, tb) in pairs if b > a]


def trainer(root: Path, callbacks: list[pl.Callback], steps: int, every: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        log_every_n_steps=every,
        logger=TensorBoardLogger(root, name="", version=None),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def fit(module: GPT2, root: Path, callbacks: list[pl.Callback], steps: int, every: int) -> float:
    """``trainer(...).fit(module)``, saying which fit starts and how long it took (returned, in seconds): a run cut
    short shows where."""
    label = "/".join(root.parts[-3:])
    print(f"  {label} ...", flush=True)
    start = time.perf_counter()
    try:
        trainer(root, callbacks, steps, every).fit(module)
    finally:
        seconds = time.perf_counter() - start
        print(f"  {label}: {seconds:.1f} s", flush=True)
    return seconds


class Results:
    """Everything measured, written to ``gpu.json`` after each section."""

    def __init__(self, out: Path, size: str) -> None:
        self.out = out
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
        self.data: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "device": gpu,
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "python": platform.python_version(),
            "size": size,
            "sections": {},
        }

    def put(self, section: str, value: Any) -> None:
        self.data["sections"][section] = value
        (self.out / "gpu.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "gpu.md").write_text(table(self.data) + "\n")


@contextlib.contextmanager
def section(results: Results, name: str) -> Iterator[dict[str, Any]]:
    """Collects a section's figures; an exception is recorded in it instead of ending the script."""
    found: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        yield found
    except Exception as error:  # the later sections still run
        found["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        found["traceback"] = traceback.format_exc()[-3000:]
        print(f"[{name}] failed: {found['error']}", flush=True)
    found["seconds"] = round(time.perf_counter() - start, 1)
    results.put(name, found)
    print(f"[{name}] done in {found['seconds']} s", flush=True)


def step_times(
    results: Results,
    root: Path,
    modules: dict[str, GPT2],
    rounds: int,
    windows: int,
    deadline: float,
    names: list[str],
) -> None:
    """Section 1: rounds of fits, every variant of ``names`` once per round in a rotated order, for each mode."""
    for mode, module in modules.items():
        warmup = WARMUP  # compiled, both graphs are made in it: the logging one at step 0, the quiet one at step 1
        steps = warmup + windows * EVERY
        with section(results, f"step time ({mode})") as found:
            windows_ms: dict[str, list[float]] = {n: [] for n in names}
            peaks: dict[str, int] = {n: 0 for n in names}
            for r in range(rounds):
                if r and time.perf_counter() > deadline:
                    break
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    clock = Clock(warmup, EVERY)
                    where = root / mode / name.replace(" ", "_").replace(",", "") / str(r)
                    torch._dynamo.utils.counters.clear()
                    seconds = fit(module, where, [clock, *TIMED[name]()], steps, EVERY)
                    if mode == "compiled":  # what dynamo did during this fit: graphs made, breaks and why
                        counters = torch._dynamo.utils.counters
                        found.setdefault("dynamo", {}).setdefault(name, []).append(
                            {
                                "unique_graphs": counters["stats"].get("unique_graphs", 0),
                                "graph_breaks": dict(counters["graph_break"].most_common(5)),
                                "recompiles": sum(counters["recompiles"].values()),
                            }
                        )
                    windows_ms[name] += [ms for _, ms in clock.step_ms()]
                    peaks[name] = max(peaks[name], clock.peak)
                    found.setdefault("fit_seconds", {}).setdefault(name, []).append(round(seconds, 1))
                    found["rounds"] = r + 1  # written after every fit: a run cut short keeps the fits it finished
                    done = {n: v for n, v in windows_ms.items() if v}
                    found["ms_per_step"] = {n: _median(v) for n, v in done.items()}
                    found["windows"] = windows_ms
                    ms = found["ms_per_step"]
                    found["ratio"] = {n: v / ms.get(baseline(n), math.nan) for n, v in ms.items()}
                    found["peak_bytes"] = peaks
                    found["peak_ratio"] = {
                        n: v / peaks["without callbacks"] for n, v in peaks.items() if v and peaks["without callbacks"]
                    }
                    results.put(f"step time ({mode})", found)


def baseline(variant: str) -> str:
    """The fit a step-time variant is measured against: the one without callbacks, with the same optimizer."""
    return "without callbacks, fused AdamW" if variant.endswith("fused AdamW") else "without callbacks"


def logging_step(results: Results, root: Path, modules: dict[str, GPT2]) -> None:
    """Section 2: every step timed between synchronisations, logging every 10 steps: the logging step's extra time
    for each of ``LOGGING_VARIANTS`` (eager; compiled, the first two)."""
    every, steps = 10, 60
    for mode, module in modules.items():
        with section(results, f"logging step ({mode})") as found:
            names = list(LOGGING_VARIANTS) if mode == "eager" else list(LOGGING_VARIANTS)[:2]
            for name in names:
                clock = Clock(0, 1)
                where = root / "logging" / mode / name.replace(" ", "_").replace(",", "")
                fit(module, where, [clock, *LOGGING_VARIANTS[name]()], steps, every)
                times = [(s, ms) for s, ms in clock.step_ms() if s >= WARMUP]
                logging = [ms for s, ms in times if s % every == 0]
                quiet = [ms for s, ms in times if s % every]
                found[name] = {
                    "logging_ms": _median(logging),
                    "quiet_ms": _median(quiet),
                    "extra_ms": _median(logging) - _median(quiet),
                    "logging_steps": len(logging),
                    "first_step_ms": clock.step_ms()[0][1],
                    "peak_bytes": clock.peak,
                }
                results.put(f"logging step ({mode})", found)


def memory_logger(results: Results, root: Path, module: GPT2) -> None:
    """Section 6: MemoryLogger on the GPU: its peak of the recorded step against ``torch.cuda.max_memory_allocated``
    over that step, and the recorded step's time against a quiet one's."""
    from lightning_hooks import MemoryLogger

    with section(results, "MemoryLogger against the allocator") as found:

        class Peak(pl.Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
                if trainer.global_step == 2:
                    sync()
                    torch.cuda.reset_peak_memory_stats()

            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                if trainer.global_step == 3:  # step 2 has been counted
                    sync()
                    found["allocator_peak_bytes"] = torch.cuda.max_memory_allocated()

        logger, clock = MemoryLogger(at_step=2), Clock(0, 1)
        fit(module, root / "memory_logger", [clock, Peak(), logger], 8, EVERY)
        times = dict(clock.step_ms())
        found.update(
            memory_logger_peak_bytes=logger.peak,
            peak_at=logger.peak_at,
            ratio=logger.peak / found["allocator_peak_bytes"],
            recorded_step_ms=times[2],
            quiet_step_ms=_median([times[s] for s in (4, 5, 6)]),
            summary=logger.summary,
        )
        recorded_step_floors(found, root, module)


def recorded_step_floors(found: dict[str, Any], root: Path, module: GPT2) -> None:
    """What any tracker that sees every operator from Python costs on that step, and torch's ``MemTracker`` at least
    (``benchmarks/memory_step.py``): the step under an empty dispatch mode, and under that and torch's ``ModTracker``,
    each against the same fit's quiet steps."""
    from benchmarks.memory_step import EmptyMode

    for name, modules in (("empty_dispatch_mode", False), ("empty_mode_and_mod_tracker", True)):
        clock = Clock(0, 1)
        fit(module, root / "memory_floors" / name, [clock, EmptyMode(2, modules)], 8, EVERY)
        times = dict(clock.step_ms())
        found[f"{name}_ratio"] = times[2] / _median([times[s] for s in (4, 5, 6)])


def profile_logging_step(results: Results, root: Path, module: GPT2, out: Path) -> None:
    """Section 5: where the host's time goes in logging steps of all six (cProfile, eager), into ``profile.txt``."""
    every, steps = 10, 32
    with section(results, "logging step profile (eager)") as found:
        profiler = cProfile.Profile()

        class Start(pl.Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
                if trainer.global_step in (20, 30):
                    sync()
                    profiler.enable()

        class End(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                if trainer.global_step - 1 in (20, 30):  # the step has been counted by now
                    sync()
                    profiler.disable()

        fit(module, root / "profile", [Start(), *all_six(), End()], steps, every)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(80)
        (out / "profile.txt").write_text(text.getvalue())
        found["ms_per_logging_step"] = 1e3 * stats.total_tt / 2  # type: ignore[attr-defined]


class SyncDebug(pl.Callback):
    """Sets ``torch.cuda.set_sync_debug_mode(mode)`` from the start of each quiet step to its end (a pair of
    callbacks: ``start`` goes first in the list, ``end`` last)."""

    def __init__(self, mode: str, every: int) -> None:
        self.mode, self.every = mode, every
        self.quiet_steps = 0
        outer = self

        class Start(pl.Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
                if trainer.global_step % outer.every:
                    outer.quiet_steps += 1
                    torch.cuda.set_sync_debug_mode(outer.mode)

        class End(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                torch.cuda.set_sync_debug_mode(0)

            def on_exception(self, *args: Any) -> None:
                torch.cuda.set_sync_debug_mode(0)

        self.start, self.end = Start(), End()


def sync_checks(results: Results, root: Path, modules: dict[str, GPT2]) -> None:
    """Section 3: the synchronisations of quiet steps, counted with ``"warn"`` against the fit without callbacks;
    then, where that fit has none, every callback but NonFiniteGuard under ``"error"``."""
    every, steps = 5, 16

    def without_guard() -> list[pl.Callback]:
        return [c for c in all_six() if not isinstance(c, NonFiniteGuard)]

    cases: dict[str, Callable[[], list[pl.Callback]]] = {
        "without callbacks": list,
        "all but NonFiniteGuard": without_guard,
        "NonFiniteGuard": lambda: [NonFiniteGuard()],
    }
    for mode, module in modules.items():
        with section(results, f"synchronisations ({mode})") as found:
            # compiling anew for every fit is slow: the compiled model gets the two cases that matter most
            names = list(cases) if mode == "eager" else ["without callbacks", "all but NonFiniteGuard"]
            for name in names:
                where = root / "sync" / mode / name.replace(" ", "_")
                found[name] = _sync_fit(where, module, cases[name], "warn", every, steps)
                results.put(f"synchronisations ({mode})", found)
            if found["without callbacks"]["syncs"] == 0:
                found["all but NonFiniteGuard, error mode"] = _sync_fit(
                    root / "sync" / mode / "error", module, without_guard, "error", every, steps
                )


def _sync_fit(
    root: Path, module: GPT2, make: Callable[[], list[pl.Callback]], debug: str, every: int, steps: int
) -> dict[str, Any]:
    meter = SyncDebug(debug, every)
    entry: dict[str, Any] = {"mode": debug}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit(module, root, [meter.start, *make(), meter.end], steps, every)
        except Exception as error:
            entry["error"] = str(error).splitlines()[0][:300]
            entry["where"] = _our_frames(error)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    entry.update(
        quiet_steps=meter.quiet_steps,
        syncs=len(syncs),
        at=sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs}),
    )
    return entry


def memory_tools(results: Results, root: Path, module: GPT2, rounds: int) -> None:
    """Section 4: what MemoryLogger (#33) will build on, measured where it will run."""
    steps = WARMUP + EVERY
    with section(results, "memory history cost (eager)") as found:
        # "on": torch's defaults (every event's C++ and Python stacks); "lean": what MemoryLogger(snapshot_on_oom=True)
        # records from the start of a fit (Python stacks of allocations only).
        # "no stacks": the events alone (sizes, addresses, times), no stack gathered: what a cheaper default could be.
        settings: dict[str, dict[str, Any]] = {
            "on": {},
            "lean": {"context": "alloc", "stacks": "python"},
            "no stacks": {"context": None},
        }
        times: dict[str, list[float]] = {"off": [], **{k: [] for k in settings}}
        for r in range(rounds):
            order = list(times)
            for state in order[r % len(order) :] + order[: r % len(order)]:
                if state != "off":
                    torch.cuda.memory._record_memory_history(max_entries=100_000, **settings[state])
                clock = Clock(WARMUP, EVERY)
                try:
                    fit(module, root / "history" / f"{state}{r}", [clock], steps, EVERY)
                finally:
                    if state != "off":
                        torch.cuda.memory._record_memory_history(enabled=None)
                times[state] += [ms for _, ms in clock.step_ms()]
        found.update(ms_per_step={k: _median(v) for k, v in times.items()}, windows=times)
        found["ratio"] = found["ms_per_step"]["on"] / found["ms_per_step"]["off"]
        found["ratio_lean"] = found["ms_per_step"]["lean"] / found["ms_per_step"]["off"]
        found["ratio_no_stacks"] = found["ms_per_step"]["no stacks"] / found["ms_per_step"]["off"]

    with section(results, "snapshot on out of memory") as found:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        module.oom_at = 3
        try:
            fit(module, root / "oom", [], 6, EVERY)
            found["oom"] = False
        except torch.OutOfMemoryError as error:
            found["oom"] = True
            found["message"] = str(error).splitlines()[0][:200]
            path = root / "memory_snapshot.pickle"
            start = time.perf_counter()
            torch.cuda.memory._dump_snapshot(str(path))
            found["dump_s"] = time.perf_counter() - start
            found["bytes"] = path.stat().st_size
            snapshot = pickle.loads(path.read_bytes())
            actions = [e["action"] for trace in snapshot.get("device_traces", []) for e in trace]
            found["trace_entries"] = len(actions)
            found["oom_entries"] = actions.count("oom")
        finally:
            module.oom_at = None
            torch.cuda.memory._record_memory_history(enabled=None)

    with section(results, "MemTracker against the allocator") as found:
        from torch.distributed._tools.mem_tracker import MemTracker

        model: torch.nn.Module = module.model.cuda()  # type: ignore[attr-defined]  # a fit's end moved it back
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = module.tokens[: module.batch_size].cuda()

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # the optimizer's state exists from here on
        gc.collect()
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            tracked_before = _total(tracker.get_tracker_snapshot("current"))
            step()
        sync()
        # what the step adds at its peak, by each: the allocator also holds the other model and what fits left
        found["tracker_step_peak_bytes"] = _total(tracker.get_tracker_snapshot("peak")) - tracked_before
        found["allocator_step_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        found["tracker_at_start_bytes"] = tracked_before
        peak = next(v for d, v in tracker.get_tracker_snapshot("peak").items() if torch.device(d).type == "cuda")
        found["tracker_peak_by_kind"] = {str(getattr(k, "value", k)): v for k, v in peak.items()}
        found["ratio"] = found["tracker_step_peak_bytes"] / found["allocator_step_peak_bytes"]


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    """The total of a ``MemTracker`` snapshot's CUDA device."""
    by_kind = next(v for device, v in snapshot.items() if torch.device(device).type == "cuda")
    return next((v for k, v in by_kind.items() if str(k).endswith("Total")), sum(by_kind.values()))


def _our_frames(error: BaseException) -> list[str]:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "lightning_hooks" in f.filename or "benchmarks" in f.filename]
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in (ours or frames)[-3:]]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def table(data: dict[str, Any]) -> str:
    """The markdown tables of ``gpu.json``."""
    s = data["sections"]
    lines = [f"{data['device']}, torch {data['torch']}, Lightning {data['lightning']}, {data['date']}, {data['size']}"]
    lines.append("")
    modes = [m for m in ("eager", "compiled") if f"step time ({m})" in s]
    if modes:
        heads = " | ".join(f"{m}: ms/step (× none) | {m}: peak memory (× none)" for m in modes)
        lines += [f"| variant | {heads} |"]
        lines += ["|---|" + "---:|---:|" * len(modes)]
        timed = {n for m in modes for n in s[f"step time ({m})"].get("ms_per_step", {})}
        for name in [n for n in TIMED if n in timed]:
            cells = []
            for m in modes:
                f = s[f"step time ({m})"]
                ms, ratio = f.get("ms_per_step", {}).get(name, math.nan), f.get("ratio", {}).get(name, math.nan)
                peak = f.get("peak_ratio", {}).get(name, math.nan)
                cells += [f"{ms:.2f} ({ratio:.4f})", f"{peak:.4f}"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("rounds: " + ", ".join(f"{m} {s[f'step time ({m})'].get('rounds', 0)}" for m in modes))
    for m in ("eager", "compiled"):
        for name, f in s.get(f"logging step ({m})", {}).items():
            if isinstance(f, dict) and "extra_ms" in f:
                lines.append(
                    f"logging step every 10, {name} ({m}): {f['logging_ms']:.2f} ms against {f['quiet_ms']:.2f} ms "
                    f"quiet (+{f['extra_ms']:.2f} ms); first step {f['first_step_ms']:.0f} ms"
                )
    for key, f in s.items():
        if key.startswith("synchronisations"):
            for name, e in f.items():
                if isinstance(e, dict):
                    lines.append(f"{key}, {name}: {json.dumps(e)}")
    keys = ("memory history cost (eager)", "snapshot on out of memory", "MemTracker against the allocator")
    for key in (*keys, "MemoryLogger against the allocator"):
        if key in s:
            f = {k: v for k, v in s[key].items() if k not in ("windows", "traceback")}
            lines.append(f"{key}: {json.dumps(f)}")
    errors = [f"{k}: {v['error']}" for k, v in s.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + (["", "errors:", *errors] if errors else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the whole script, roughly")
    parser.add_argument("--rounds", type=int, default=4, help="at most this many rounds of step-time fits per mode")
    parser.add_argument("--windows", type=int, default=2, help="50-step windows timed per fit")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT-2 on the CPU, a few steps: the script runs")
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument(
        "--stacks-after", type=float, default=0, help="print every thread's stack after this long, and again as often"
    )
    parser.add_argument(
        "--modes", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled"], help="in order"
    )
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=TIMED, help="step-time fits")
    args = parser.parse_args()
    if args.stacks_after:  # a thread of faulthandler's: Lightning puts every signal's handler back after each fit
        faulthandler.dump_traceback_later(args.stacks_after, repeat=True)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if not torch.cuda.is_available() and not args.smoke:
        parser.error("no CUDA GPU here; use --smoke to check the script on the CPU")
    global EVERY, WARMUP
    if args.smoke:
        EVERY, WARMUP = 5, 2
        args.rounds, args.windows = min(args.rounds, 2), 1
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    size = "smoke" if args.smoke else "gpt2-small"
    results = Results(args.out, size)
    torch.manual_seed(0)
    modules = {mode: GPT2(size, compiled=mode == "compiled") for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cuda = torch.cuda.is_available()
        # The modes in the order asked. By default every eager part comes first: compiling is the slowest and least
        # predictable part (run 6's compiled fits outlasted the budget and took the later sections with them), so a run
        # cut short keeps the rest. The eager step times get up to 30 % of the budget, the compiled ones up to 25 % from
        # where they start. Without "without callbacks" among the step-time variants, their ratios are NaN.
        for mode in args.modes:
            share = {"eager": 0.3, "compiled": 0.25}[mode]
            one = {mode: modules[mode]}
            names = ["time", "logging", "sync"] + (["memory_logger", "memory", "profile"] if mode == "eager" else [])
            for name in (n for n in names if n in args.sections):
                if time.perf_counter() - start > 1.1 * args.budget:
                    results.put(f"{name} ({mode})", {"skipped": "out of time"})
                elif name == "time":
                    deadline = time.perf_counter() + share * args.budget
                    step_times(results, root, one, args.rounds, args.windows, deadline, args.variants)
                elif name == "logging":
                    logging_step(results, root, one)
                elif name == "profile":
                    profile_logging_step(results, root, modules["eager"], args.out)
                elif not cuda:
                    continue  # the synchronisation and allocator checks need a GPU
                elif name == "sync":
                    sync_checks(results, root, one)
                elif name == "memory_logger":
                    memory_logger(results, root, modules["eager"])
                else:
                    memory_tools(results, root, modules["eager"], rounds=2)
    results.data["seconds"] = round(time.perf_counter() - start, 1)
    results.put("total", {"seconds": results.data["seconds"]})
    print(table(results.data))


if __name__ == "__main__":
    main()
