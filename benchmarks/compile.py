"""Step times, graphs and graph breaks of a torch.compile'd model with and without the callbacks.

    .venv/bin/python benchmarks/compile.py [--steps 200] [--every 10] [--repeats 3]
    .venv/bin/python benchmarks/compile.py --instructions [--every 10] [--only NAME ...]

The transformer's encoder is compiled inside the LightningModule (``model.encoder =
torch.compile(model.encoder)``), with no dynamo setting. Variants, run interleaved (each repeat
runs every variant once, in turn): eager without callbacks; compiled without callbacks (the
baseline); compiled with ActivationStats alone; with ShapeLogger + GradStats + ActivationStats;
with GradClamp; with NonFiniteGuard (replay, every step checked). The observers log every
``--every`` steps. Per variant: the median step time of steps that log nothing and of logging
steps (leaving out the first 30 steps and the first logging step after them: compiles), each
relative to the mean of the baseline fits run just before and just after it (the baseline runs
between every two variants, so a machine that drifts over a repeat moves both sides alike); the
spread of that ratio over repeats; and, from dynamo's own counters, the graphs compiled and the
graph breaks over the whole fit, and the recompile-limit warnings dynamo logged.

With ``--instructions``, each compiled variant instead runs once under valgrind's callgrind, in
processes side by side, one intra-op thread (see ``_callgrind.py``): compiles run uninstrumented,
and steps ``every`` to ``3 * every - 1`` are counted (two logging steps; both graphs of the
region are compiled by then). ``--only`` picks variants. Instruction counts do not depend on
the machine's load, so they resolve the 1 % that wall time on a shared machine cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import StepInstructions, StepProbe, StepTimer, quiet  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import (  # noqa: E402
    ActivationStats,
    GradClamp,
    GradStats,
    NonFiniteGuard,
    ShapeLogger,
)

SKIP = 30
"""Steps left out at the start of each fit (compiles)."""


class LimitWarnings(logging.Handler):
    """Counts dynamo's warnings that a function hit its recompile limit."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.count += 1


def fit(
    compiled: bool,
    callbacks: list[pl.Callback],
    steps: int,
    every: int,
    root: str,
    probe: StepProbe | None = None,
) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    model, data = TinyTransformerLM(), TokenDataModule()
    if compiled:
        model.encoder = torch.compile(model.encoder)  # type: ignore[assignment]
    timer = probe or StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        log_every_n_steps=every,
        logger=pl.loggers.TensorBoardLogger(root),
        callbacks=[timer, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model, datamodule=data)
    return [(step, seconds) for step, seconds, _ in timer.steps]


def variants(every: int) -> dict[str, tuple[bool, Callable[[], list[pl.Callback]]]]:
    return {
        "eager, no callbacks": (False, lambda: []),
        "compiled, no callbacks": (True, lambda: []),
        "compiled, ActivationStats": (True, lambda: [ActivationStats(log_every_n_steps=every)]),
        "compiled, ShapeLogger + GradStats + ActivationStats": (
            True,
            lambda: [
                ShapeLogger(log_every_n_steps=every),
                GradStats(log_every_n_steps=every),
                ActivationStats(log_every_n_steps=every),
            ],
        ),
        "compiled, GradClamp(1.0)": (True, lambda: [GradClamp(1.0, log_every_n_steps=every)]),
        "compiled, NonFiniteGuard (replay, every step)": (True, lambda: [NonFiniteGuard()]),
    }


def count_child(name: str, out: str, every: int) -> None:
    """Under callgrind: one fit of variant ``name``, its steps ``every`` to ``3 * every - 1`` counted."""
    torch.set_num_threads(1)
    compiled, callbacks = variants(every)[name]
    first = every
    probe = StepInstructions(first, 2 * every)
    counters.clear()
    with tempfile.TemporaryDirectory() as root:
        steps = fit(compiled, callbacks(), first + 2 * every + 1, every, root, probe)
    row = {"variant": name, "steps": steps, "graphs": counters["stats"]["unique_graphs"]}
    row["breaks"] = sum(counters["graph_break"].values())
    Path(out).write_text(json.dumps(row))


def count_instructions(every: int, only: list[str] | None) -> None:
    from benchmarks import _callgrind

    _callgrind.require()
    table = [name for name, (compiled, _) in variants(every).items() if compiled and (not only or name in only)]
    print(
        f"torch {torch.__version__}, valgrind's callgrind, 1 thread; logging every {every}, steps counted: "
        f"{every}-{3 * every - 1}, one run per variant\n"
    )
    with _callgrind.workspace() as (out_dir, library):
        # Inductor compiles its kernels with `-march=native`, which may use instructions valgrind
        # cannot run (AVX-512): the children compile their own (no on-disk cache) for AVX2.
        os.environ.update(
            TORCHINDUCTOR_CACHE_DIR=str(out_dir / "inductor"),
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
            TORCHINDUCTOR_CPP_MARCH="x86-64-v3",
            ATEN_CPU_CAPABILITY="avx2",
        )
        children = {}
        for i, name in enumerate(table):
            out, log = out_dir / f"{i}.json", out_dir / f"{i}.log"
            python = [sys.executable, __file__, "--count-child", name, str(out), "--every", str(every)]
            children[name] = (_callgrind.start(python, out_dir, library, log), out, log)
        rows = {}
        for name, (child, out, log) in children.items():
            if child.wait() != 0:
                sys.exit(f"{name}: the counting process failed:\n{log.read_text()[-3000:]}")
            rows[name] = json.loads(out.read_text())

    def quiet_steps(name: str) -> float:
        return statistics.median(n for s, n in rows[name]["steps"] if s % every)

    def logging_steps(name: str) -> float:
        return statistics.median(n for s, n in rows[name]["steps"] if s % every == 0)

    base = table[0]
    print(
        "| variant | M instructions, quiet step | × compiled | M instructions, logging step | × compiled | graphs "
        "| graph breaks |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in table:
        q, lg = quiet_steps(name), logging_steps(name)
        print(
            f"| {name} | {q / 1e6:.2f} | {q / quiet_steps(base):.4f} | {lg / 1e6:.2f} "
            f"| {lg / logging_steps(base):.3f} | {rows[name]['graphs']} | {rows[name]['breaks']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    parser.add_argument(
        "--only", nargs="+", help="these variants only (with --instructions, the first is the baseline)"
    )
    parser.add_argument("--count-child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.count_child:
        count_child(*args.count_child, args.every)
        return
    if args.instructions:
        count_instructions(args.every, args.only)
        return
    limits = LimitWarnings()
    logging.getLogger("torch._dynamo").addHandler(limits)
    every = args.every
    baseline = "compiled, no callbacks"
    table = {name: v for name, v in variants(every).items() if not args.only or name in (*args.only, baseline)}
    quiet_ms: dict[str, list[float]] = {name: [] for name in table}
    logging_ms: dict[str, list[float]] = {name: [] for name in table}
    quiet_ratio: dict[str, list[float]] = {name: [] for name in table}
    logging_ratio: dict[str, list[float]] = {name: [] for name in table}
    graphs: dict[str, int] = {}
    breaks: dict[str, int] = {}
    limit_warnings: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:

        def run(name: str) -> tuple[float, float]:
            """One fit of ``name``: the median step time of its quiet steps and of its logging steps."""
            compiled, callbacks = table[name]
            torch._dynamo.reset()
            counters.clear()
            limits.count = 0
            times = fit(compiled, callbacks(), args.steps, every, root)
            graphs[name] = counters["stats"]["unique_graphs"]
            breaks[name] = sum(counters["graph_break"].values())
            limit_warnings[name] = limits.count
            first_logging = (SKIP // every + 1) * every
            quiet_ms[name].append(statistics.median(t for s, t in times if s > SKIP and s % every))
            logging_ms[name].append(statistics.median(t for s, t in times if s > first_logging and s % every == 0))
            print(
                f"# {name}: quiet {quiet_ms[name][-1] * 1e3:.2f} ms, logging {logging_ms[name][-1] * 1e3:.2f} ms, "
                f"{graphs[name]} graphs, {breaks[name]} breaks, {limits.count} recompile-limit warnings",
                flush=True,
            )
            return quiet_ms[name][-1], logging_ms[name][-1]

        # The baseline runs before and after every variant, which is compared with the mean of the two:
        # a shared machine drifts by several percent over a repeat, about linearly over a fit or two.
        for _ in range(args.repeats):
            before = run(baseline)
            for name in table:
                if name == baseline:
                    continue
                quiet_time, logging_time = run(name)
                after = run(baseline)
                quiet_ratio[name].append(quiet_time / ((before[0] + after[0]) / 2))
                logging_ratio[name].append(logging_time / ((before[1] + after[1]) / 2))
                before = after
            quiet_ratio[baseline].append(1.0)
            logging_ratio[baseline].append(1.0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats x "
        f"{args.steps} steps, logging every {every}\n"
    )
    print(
        "| variant | ms/step, quiet | × compiled, quiet (min–max) | ms/step, logging | × compiled, logging "
        "| graphs | graph breaks | recompile-limit warnings |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in table:
        q, lg = statistics.median(quiet_ms[name]), statistics.median(logging_ms[name])
        qr, lr = quiet_ratio[name], logging_ratio[name]
        print(
            f"| {name} | {q * 1e3:.2f} | {statistics.median(qr):.3f} ({min(qr):.3f}–{max(qr):.3f}) "
            f"| {lg * 1e3:.2f} | {statistics.median(lr):.2f} | {graphs[name]} | {breaks[name]} "
            f"| {limit_warnings[name]} |"
        )


if __name__ == "__main__":
    main()
