"""What one logging step of ``GradStats`` + ``ActivationStats`` costs on a large model, and what it is made of.

    .venv/bin/python benchmarks/logging_step.py                          # this checkout, encoder24
    .venv/bin/python benchmarks/logging_step.py --before ../main         # before/after, interleaved
    .venv/bin/python benchmarks/logging_step.py --floor                  # and the least observing can cost

Each run is one fit in a fresh process (``--repeats`` of them, the code bases alternating when
``--before`` names another checkout, whose ``lightning_hooks`` is then imported instead of this
one's): the two callbacks with their defaults (histograms off unless ``--histograms``) log every
``--every`` steps. A logging step's cost is its time minus the median quiet step of the same
fit, on the main thread's CPU clock (``time.thread_time``: what the process did, whatever else
the shared machine does) and on the wall clock. The CPU cost is split by timing, on that clock,
every call of the functions that do each part:

* **reduction kernels**: the statistics on device (``observe``, ``observe_many``, the row-wise
  reductions of queued copies, the pooling in ``fetch``, histogram samples and counts, the update
  ratios; the copies taken in the hooks count as host work);
* **event writing**: TensorBoard's backend building and writing the events (main thread), plus
  the checksums and writes of TensorBoard's record writer, which runs on its own thread (given
  apart: it takes the GIL from training while it runs);
* **host work per key**: the rest of the logging step's extra time (hook bodies, keys, pooling
  bookkeeping, tags, derived statistics, the sink).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE_ENV = "LIGHTNING_HOOKS_FROM"
if os.environ.get(BEFORE_ENV):  # another checkout's package, imported before this checkout goes on the path
    sys.path.insert(0, os.environ[BEFORE_ENV])
    import lightning_hooks  # noqa: F401
sys.path.insert(1 if os.environ.get(BEFORE_ENV) else 0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from benchmarks.overhead import WORKLOADS, quiet  # noqa: E402
from lightning_hooks import ActivationStats, GradStats  # noqa: E402
from lightning_hooks.core.handles import HookHandles  # noqa: E402
from lightning_hooks.core.select import ModuleSelector  # noqa: E402
from lightning_hooks.recorders import gradients as _gradients  # noqa: E402
from lightning_hooks.sinks import sink as _sink  # noqa: E402
from lightning_hooks.stats import batch as _stats  # noqa: E402

PARTS = ("reductions", "events", "writer thread")


class Clock:
    """CPU time spent inside chosen functions, per part, on the thread that called them."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)
        self._depth = 0

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name, None)
        if original is None:  # a function this code base does not have
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth and part != "writer thread":  # an inner call is already counted
                return original(*args, **kwargs)
            self._depth += part != "writer thread"
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - start
                self._depth -= part != "writer thread"

        setattr(owner, name, timed)


def instrument(clock: Clock) -> None:
    from tensorboard.summary.writer import record_writer

    for name in (
        "observe",
        "observe_many",
        "observe_rows",
        "_pooled",
        "histogram",
        "histograms",
        "histogram_rows",
        "sample",
    ):
        clock.wrap(_stats, name, "reductions")
    clock.wrap(_stats.StatBatch, "_reduce", "reductions")  # the row-wise reductions of queued copies
    clock.wrap(_gradients._UpdateRatio, "__call__", "reductions")
    clock.wrap(_sink.TensorBoardBackend, "write", "events")
    clock.wrap(_sink.TensorBoardBackend, "layout", "events")
    clock.wrap(record_writer.RecordWriter, "write", "writer thread")
    with contextlib.suppress(ImportError):
        from lightning_hooks.sinks.events import CRecordWriter

        clock.wrap(CRecordWriter, "write", "writer thread")


class Steps(pl.Callback):
    """Each step's main-thread CPU time, wall time and the clock's parts, batch start to batch start."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.rows, self._last = clock, [], None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        now = (time.thread_time(), time.perf_counter(), dict(self.clock.spent))
        if self._last is not None:
            cpu, wall, parts = self._last
            spent = {p: now[2][p] - parts[p] for p in PARTS}
            self.rows.append((trainer.global_step - 1, now[0] - cpu, now[1] - wall, spent))
        self._last = now


class Floor(pl.Callback):
    """What observing every module's outputs and output gradients costs at the least, for comparison.

    On logging steps, every module the two callbacks select gets, like theirs, two forward hooks
    (one for the output, one that puts a pre-hook on the autograd node that made it, for its
    gradient), registered as theirs are (:meth:`HookHandles.add_forward_hooks`) and removed at the
    batch's end. ``kind``:

    * ``"hooks"``: the hooks do nothing else, which is torch's price for the hooks alone
      (registration, ``nn.Module.__call__``'s slow path, autograd calling Python);
    * ``"sums"``: each takes one reduction of each tensor (its sum), brought to the host in one
      transfer: one operator per tensor, against the six statistics the callbacks derive;
    * ``"rows"``: each copies each tensor into the next row of the bucket kept for its shape (the
      one :class:`~lightning_hooks.stats.batch.StatBatch` uses: an in-place op after the hook must not change
      what was taken), and full buckets are reduced to the six statistics by the callbacks' own
      kernels (:func:`~lightning_hooks.stats.batch.observe_rows`; larger tensors by
      :func:`~lightning_hooks.stats.batch.observe`), one transfer at the end: the statistics of
      outputs and output gradients with no key, no pooling and no buffer allocated during the step (a
      tensor taken again unchanged, a block's output that is its last child's, is taken once, as theirs);
    * ``"params"``: ``"rows"``, and before the optimizer step every parameter gradient the same way
      (what ``GradStats`` reports of them besides: update ratios, is left out).

    With ``histograms`` (``"rows"`` and ``"params"``) the rows of each full bucket are also counted into 64 bins each
    (:func:`~lightning_hooks.stats.batch.histogram_rows`, on a copy of the rows in a buffer kept all fit: no
    sample of its own).
    No tags, no events.
    """

    def __init__(self, every: int, kind: str, histograms: bool = False) -> None:
        self.every, self.kind, self.histograms = every, kind, histograms
        self.logging = False
        self.modules: list[torch.nn.Module] = []
        self.params: list[torch.nn.Parameter] = []
        self.handles = HookHandles()
        self.taken: list[torch.Tensor] = []
        self.buckets: dict[torch.Size, _stats._Bucket] = {}
        """Per shape, the callbacks' bucket of rows over ``ROW_CHUNK`` float32 elements, kept all fit."""
        self.last: tuple[torch.Tensor | None, int] = (None, 0)
        self.scratch = torch.empty(_stats.ROW_CHUNK)
        """Where the rows are counted into histograms (``histogram_rows`` overwrites them): fresh memory would cost
        a page fault per 4 KB."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.modules = [module for _, module in ModuleSelector().select(pl_module)]  # once, as the callbacks do
        self.params = [param for param in pl_module.parameters() if param.requires_grad]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.logging = trainer.global_step % self.every == 0
        if not self.logging:
            return
        self.handles.add_forward_hooks([(module, self.output) for module in self.modules])
        self.handles.add_forward_hooks([(module, self.gradient) for module in self.modules])

    def output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.take(output)

    def take(self, t: torch.Tensor) -> None:
        if self.kind == "sums":
            self.taken.append(t.detach().sum())
        elif self.kind in ("rows", "params"):
            if t is self.last[0] and t._version == self.last[1]:  # a block's output is its last child's: once
                return
            self.last = (t, t._version)
            if t.numel() > _stats.ROW_MAX:
                self.taken.append(_stats.observe(t).raw)  # type: ignore[arg-type]
                if self.histograms:
                    self.taken.append(_stats.histogram(_stats.sample(t), 64))
                return
            bucket = self.buckets.get(t.shape)
            if bucket is None:
                bucket = self.buckets[t.shape] = _stats._Bucket(torch.empty(_stats.ROW_CHUNK), t.shape)
            bucket.slot().copy_(t.detach())
            bucket.taken += 1
            if bucket.taken == bucket.capacity:
                self.reduce(bucket)

    def reduce(self, bucket: _stats._Bucket) -> None:
        rows = bucket.copies[: bucket.taken].view(bucket.taken, -1)
        if self.histograms:  # counted from the rows' copy: no sample of its own, one count per row
            self.taken.append(_stats.histogram_rows(self.scratch[: rows.numel()].view_as(rows).copy_(rows), 64))
        self.taken.append(_stats.observe_rows(rows))
        bucket.taken = 0  # its row views serve again

    def gradient(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            output.grad_fn.register_prehook(functools.partial(self.read, output.output_nr))

    def read(self, index: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        grad = grads[index]
        if grad is not None:
            self.take(grad)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.logging and self.kind == "params":
            for param in self.params:
                if param.grad is not None:
                    self.take(param.grad)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.handles.remove()
        self.last = (None, 0)
        for bucket in self.buckets.values():
            if bucket.taken:
                self.reduce(bucket)
        if self.taken:
            torch.cat([t.reshape(-1) for t in self.taken]).tolist()
            self.taken = []


def run(workload: str, steps: int, every: int, histograms: bool, floor: str | None = None) -> dict[str, Any]:
    """One fit; the logging steps' extra cost and its parts, in milliseconds."""
    quiet()
    clock = Clock()
    instrument(clock)
    probe = Steps(clock)
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    callbacks: list[pl.Callback]
    if floor is not None:
        callbacks = [Floor(every, floor, histograms)]
    else:
        callbacks = [GradStats(log_every_n_steps=every, histograms=histograms)]
        callbacks.append(ActivationStats(log_every_n_steps=every, histograms=histograms))
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + 1,
            log_every_n_steps=every,
            logger=TensorBoardLogger(root),
            callbacks=[probe, *callbacks],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, datamodule=data)
    kept = [row for row in probe.rows if row[0] >= every]  # the first logging step also builds the layout
    quiet_rows = [row for row in kept if row[0] % every]
    logging_rows = [row for row in kept if row[0] % every == 0]
    quiet_cpu = statistics.median(row[1] for row in quiet_rows)
    quiet_wall = statistics.median(row[2] for row in quiet_rows)
    extra_cpu = statistics.median(row[1] - quiet_cpu for row in logging_rows)
    parts = {p: statistics.median(row[3][p] for row in logging_rows) for p in PARTS}
    # The writer thread writes a step's events while the next step runs: its time over the fit, per logging step.
    parts["writer thread"] = sum(row[3]["writer thread"] for row in kept) / len(logging_rows)
    return {
        "quiet_cpu": 1e3 * quiet_cpu,
        "quiet_wall": 1e3 * quiet_wall,
        "extra_cpu": 1e3 * extra_cpu,
        "extra_wall": 1e3 * statistics.median(row[2] - quiet_wall for row in logging_rows),
        "reductions": 1e3 * parts["reductions"],
        "events": 1e3 * parts["events"],
        "host per key": 1e3 * (extra_cpu - parts["reductions"] - parts["events"]),
        "writer thread": 1e3 * parts["writer thread"],
        "parameters": sum(1 for _ in model.parameters()),
        "modules": sum(1 for _ in model.modules()),
    }


@contextlib.contextmanager
def package_of(checkout: Path) -> Iterator[str]:
    """A directory holding only ``checkout``'s ``lightning_hooks``, to put first on a child's path."""
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "lightning_hooks").symlink_to(checkout.resolve() / "lightning_hooks")
        yield directory


def child(args: argparse.Namespace, before: str | None, floor: str | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", args.workload, "--steps", str(args.steps)]
    command += ["--every", str(args.every), *(["--histograms"] if args.histograms else [])]
    command += ["--floor-of", floor] if floor is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop(BEFORE_ENV, None)
    if before is not None:
        env[BEFORE_ENV] = before
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(name: str, runs: list[dict[str, Any]]) -> None:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    extra, ratio = med("extra_cpu"), med("extra_cpu") / med("quiet_cpu")
    print(
        f"| {name} | {med('quiet_cpu'):.1f} / {med('quiet_wall'):.1f} | {extra:.1f} ({ratio:.2f}) "
        f"/ {med('extra_wall'):.1f} | {med('reductions'):.1f} | {med('host per key'):.1f} | {med('events'):.1f} "
        f"| {med('writer thread'):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="encoder24", choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each fit")
    parser.add_argument("--histograms", action="store_true")
    parser.add_argument("--before", type=Path, help="another checkout to measure against, interleaved")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the least that observing every output and output gradient costs (see Floor)",
    )
    parser.add_argument("--child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    parser.add_argument("--floor-of", choices=["hooks", "sums", "rows", "params"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(run(args.child, args.steps, args.every, args.histograms, args.floor_of)))
        return
    bases: dict[str, Callable[[], contextlib.AbstractContextManager[str | None]]] = {
        "this checkout": contextlib.nullcontext
    }
    if args.before is not None:
        bases = {f"before ({args.before})": lambda: package_of(args.before), **bases}
    floors = {
        "hooks that do nothing (floor)": "hooks",
        "hooks + one sum per tensor (floor)": "sums",
        "hooks + copies + six statistics in rows (floor)": "rows",
        "the same + parameter gradients (floor)": "params",
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*bases, *(floors if args.floor else ())]}
    for _ in range(args.repeats):
        for name, base in bases.items():
            with base() as path:
                runs[name].append(child(args, path))
        for name, kind in floors.items() if args.floor else ():
            runs[name].append(child(args, None, kind))
    first = next(iter(runs.values()))[0]
    print(
        f"{time.strftime('%Y-%m-%d')}, {args.workload} ({first['parameters']} parameter tensors, {first['modules']} "
        f"modules), GradStats + ActivationStats every {args.every} steps, histograms "
        f"{'on' if args.histograms else 'off'}, {args.threads} thread(s), medians of {args.repeats} fits x "
        f"{args.steps} steps; milliseconds\n"
    )
    print(
        "| code | quiet step, CPU / wall | logging step's extra, CPU (× quiet) / wall | reduction kernels "
        "| host work per key | event writing | writer thread |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, found in runs.items():
        report(name, found)


if __name__ == "__main__":
    main()
