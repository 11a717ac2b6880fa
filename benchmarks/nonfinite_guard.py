"""What NonFiniteGuard costs: per healthy step in both modes against no guard and ``detect_anomaly``,
and on the step that goes bad, the time from detection to report.

    .venv/bin/python benchmarks/nonfinite_guard.py [--repeats 5] [--steps 60] [--workloads digits-cnn transformer]
    .venv/bin/python benchmarks/nonfinite_guard.py --instructions [--workloads digits-cnn resnet]

**Healthy steps.** Four variants at ``check_every_n_steps=1``: no guard, ``NonFiniteGuard()``
(``mode="replay"``: the sentinel only), ``NonFiniteGuard(mode="eager")`` (hooks on every step)
and Lightning's ``Trainer(detect_anomaly=True)``. They run interleaved, each fit in a fresh fork
(see ``overhead.py``), in an order rotated every repeat, so that drifting machine load hits all
of them alike; each figure is the median over repeats of the per-step median inside one fit,
after ``--warmup`` steps.

**The failing step.** A fit whose first parameter is set to Inf at step ``--bad-step`` (the
first layer then makes Inf and NaN, the loss and every gradient follow), guarded by
``NonFiniteGuard()``: the time from the sentinel's verdict to the raised report (reading what it
saw, the replay of the step with hooks, the report), median over repeats, also as a multiple of
a healthy step of the same workload. Also, far less exposed to the machine's load: the CPU time
(``time.thread_time``) the replay mode's own hooks take per healthy step (the sentinel's read
included), summed over its four hooks, against the CPU time of a whole step without the guard.

**Instructions** (``--instructions``): no guard, ``NonFiniteGuard()`` and
``NonFiniteGuard(mode="eager")`` run once each in one process per workload under valgrind's
callgrind (see ``_callgrind.py``), one intra-op thread, and steps 2 and 3 (each checked at
``check_every_n_steps=1``) are counted: the ratio to no guard does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import WORKLOADS, StepInstructions, StepTimer, Variant, in_fork, quiet, run_once  # noqa: E402
from lightning_hooks import NonFiniteError, NonFiniteGuard  # noqa: E402

VARIANTS = [
    Variant("none"),
    Variant("replay (default)", lambda: [NonFiniteGuard(check_every_n_steps=1)]),
    Variant("eager", lambda: [NonFiniteGuard(check_every_n_steps=1, mode="eager")]),
    Variant("detect_anomaly", trainer={"detect_anomaly": True}),
]


class TimedGuard(NonFiniteGuard):
    """``NonFiniteGuard()`` that measures its failing step from the sentinel's verdict to the report."""

    seconds = float("nan")

    def _failed(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            super()._failed(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - start


class HookTimer(NonFiniteGuard):
    """``NonFiniteGuard()`` that adds up the CPU time its own hooks take in each optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step: dict[int, float] = {}
        self.step_cpu: dict[int, float] = {}  # the whole step's CPU time, from one batch start to the next
        self._last: tuple[int, float] | None = None

    def _timed(self, trainer: pl.Trainer, hook: Any, *args: Any) -> None:
        step, start = trainer.global_step, time.thread_time()  # CPU time: descheduling does not count
        hook(trainer, *args)
        self.per_step[step] = self.per_step.get(step, 0.0) + time.thread_time() - start

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.thread_time()
        if self._last is not None:
            self.step_cpu[self._last[0]] = now - self._last[1]
        self._last = (trainer.global_step, now)
        self._timed(trainer, super().on_train_batch_start, *args)

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._timed(trainer, super().on_before_backward, *args)

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._timed(trainer, super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._timed(trainer, super().on_train_batch_end, *args)


def sentinel_seconds(workload: str, steps: int, warmup: int, root: str) -> tuple[float, float]:
    """Median CPU time the guard's own hooks take per healthy step (the sentinel and what it keeps),
    and median CPU time of a whole step."""
    timer = HookTimer()
    run_once(workload, Variant("timed", lambda: [timer]), steps, root, StepTimer())
    own = statistics.median(t for s, t in timer.per_step.items() if warmup <= s < steps)
    return own, statistics.median(t for s, t in timer.step_cpu.items() if warmup <= s < steps)


class Poison(pl.Callback):
    """Sets the first value of the model's first parameter to Inf at the start of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("inf")


def detection_to_report(workload: str, bad_step: int, root: str) -> tuple[float, str]:
    """Seconds from the sentinel's verdict to the report on the poisoned step, and the report's first line."""
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    guard = TimedGuard()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=bad_step + 2,
        logger=False,
        callbacks=[Poison(bad_step), guard],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, datamodule=data)
    except NonFiniteError as error:
        return guard.seconds, str(error).splitlines()[1]
    raise RuntimeError("the poisoned step was not reported")


COUNTED = (2, 2)  # first step counted, how many


def count_child(workload: str, out: str) -> None:
    """Under callgrind: each variant but ``detect_anomaly`` once, the ``COUNTED`` steps counted."""
    torch.set_num_threads(1)
    counts = {}
    with tempfile.TemporaryDirectory() as root:
        for variant in VARIANTS[:3]:
            probe = StepInstructions(*COUNTED)
            steps = run_once(workload, variant, sum(COUNTED), root, probe)
            counts[variant.name] = [n for _, n, _ in steps]
    Path(out).write_text(json.dumps(counts))


def count_instructions(workloads: list[str]) -> None:
    """One callgrind process per workload, side by side."""
    from benchmarks import _callgrind

    _callgrind.require()
    first, count = COUNTED
    print(
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, callgrind, 1 thread, "
        f"steps {first}-{first + count - 1} counted"
    )
    with _callgrind.workspace() as (out_dir, library):
        children = {}
        for workload in workloads:
            out, log = out_dir / f"{workload}.json", out_dir / f"{workload}.log"
            python = [sys.executable, __file__, "--count-child", workload, str(out)]
            children[workload] = (_callgrind.start(python, out_dir, library, log), out, log)
        for workload, (child, out, log) in children.items():
            if child.wait() != 0:
                sys.exit(f"{workload}: the counting process failed:\n{log.read_text()[-3000:]}")
            counts = json.loads(out.read_text())
            base = statistics.mean(counts["none"])
            print(f"\n{workload}: {base / 1e6:.2f} M instructions per step without the guard")
            for name, steps in counts.items():
                print(f"{name:<18}{statistics.mean(steps) / 1e6:>9.2f} M{statistics.mean(steps) / base:>9.4f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--bad-step", type=int, default=20)
    parser.add_argument("--workloads", nargs="*", default=["digits-cnn", "transformer"], choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    parser.add_argument("--count-child", nargs=2, metavar=("WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        quiet()
        count_child(*args.count_child)
        return
    if args.instructions:
        quiet()
        count_instructions(args.workloads)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    print(
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} repeats x {args.steps} steps (first {args.warmup} dropped), each fit in a fresh fork"
    )
    names = [v.name for v in VARIANTS]
    with tempfile.TemporaryDirectory() as root:
        for workload in args.workloads:
            per_fit: dict[str, list[float]] = {name: [] for name in names}
            failing: list[float] = []
            sentinel: list[tuple[float, float]] = []
            for repeat in range(args.repeats):
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    variant = next(v for v in VARIANTS if v.name == name)
                    times = in_fork(lambda v=variant, w=workload: run_once(w, v, args.steps, root, StepTimer()))
                    per_fit[name].append(statistics.median(t for s, t, _ in times if s >= args.warmup))
                seconds, first_line = in_fork(lambda w=workload: detection_to_report(w, args.bad_step, root))
                failing.append(seconds)
                sentinel.append(in_fork(lambda w=workload: sentinel_seconds(w, args.steps, args.warmup, root)))
            ms = {name: statistics.median(values) * 1e3 for name, values in per_fit.items()}
            base = ms["none"]
            print(f"\n{workload}: healthy steps, check_every_n_steps=1")
            print(f"{'variant':<18}{'ms/step':>9}{'x none':>9}{'extra ms':>10}")
            for name, value in ms.items():
                print(f"{name:<18}{value:>9.2f}{value / base:>9.3f}{value - base:>10.2f}")
            own, cpu = (statistics.median(column) for column in zip(*sentinel, strict=True))
            print(
                f"replay mode, CPU time of its own hooks per healthy step: {own * 1e6:.0f} us of the step's "
                f"{cpu * 1e3:.2f} ms ({own / cpu:.2%})"
            )
            bad = statistics.median(failing) * 1e3
            print(
                f"failing step {args.bad_step}: detection to report {bad:.1f} ms "
                f"(min {min(failing) * 1e3:.1f}, max {max(failing) * 1e3:.1f}) = {bad / base:.1f} healthy steps; "
                f"reported: {first_line}"
            )


if __name__ == "__main__":
    main()
