"""What one logging step of ``GradStats`` + ``ActivationStats`` costs on a large model, against its quiet steps.

    .venv/bin/python benchmarks/logging_step.py                          # this checkout, encoder24
    .venv/bin/python benchmarks/logging_step.py --before ../main         # before/after, interleaved
    .venv/bin/python benchmarks/logging_step.py --floor                  # and what plain torch hooks cost
    .venv/bin/python benchmarks/logging_step.py --histograms             # with histograms on

Each run is one fit in a fresh process (``--repeats`` of them, the code bases alternating when
``--before`` names another checkout, whose ``lightning_hooks`` is then imported instead of this
one's): the two callbacks with their defaults (histograms off unless ``--histograms``) log every
``--every`` steps. A logging step's cost is its time minus the median quiet step of the same fit,
on the main thread's CPU clock (``time.thread_time``: what the process did, whatever else the
shared machine does) and on the wall clock. The CPU time of the process's other threads over the
fit, per logging step, is given apart: with one intra-op thread that is TensorBoard's event writer,
which writes a step's events while training goes on.

Only the library's public API is used. ``--floor`` adds fits with plain torch hooks in place of
the callbacks, on the same modules and steps (every module of the model, the LightningModule
included, as the callbacks select by default): the first two are what torch charges for observing
every output and output gradient at all, the third the plainest way to take statistics of them safely:

* ``hooks``: a forward hook per module and a tensor hook on each output, doing nothing;
* ``sums``: the same hooks take one sum of each output and output gradient, brought to the host in
  one transfer at the end of the step;
* ``copies``: the same hooks copy each output and output gradient (what in-place ops after a hook
  require), and at the end of the step the copies of each shape are stacked and reduced row by
  row (sum, sum of squares, largest magnitude, non-zero count), one transfer.
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmarks.overhead import WORKLOADS, Floor, quiet  # noqa: E402
from lightning_hooks import ActivationStats, GradStats  # noqa: E402

FLOORS = {
    "torch hooks that do nothing": "hooks",
    "torch hooks + one sum per tensor": "sums",
    "torch hooks + copies + four reductions per shape": "copies",
}


class Steps(pl.Callback):
    """Each step's main-thread CPU time, wall time and the other threads' CPU time, batch start to batch start."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float, float]] = []
        self._last: tuple[float, float, float] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        now = (time.thread_time(), time.perf_counter(), time.process_time())
        if self._last is not None:
            cpu, wall, process = (a - b for a, b in zip(now, self._last, strict=True))
            self.rows.append((trainer.global_step - 1, cpu, wall, process - cpu))
        self._last = now


def run(workload: str, steps: int, every: int, histograms: bool, floor: str | None = None) -> dict[str, Any]:
    """One fit; the logging steps' extra cost, in milliseconds."""
    quiet()
    probe = Steps()
    torch.manual_seed(0)
    model, data = WORKLOADS[workload]()
    callbacks: list[pl.Callback]
    if floor is not None:
        callbacks = [Floor(every, floor)]
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
    return {
        "quiet_cpu": 1e3 * quiet_cpu,
        "quiet_wall": 1e3 * quiet_wall,
        "extra_cpu": 1e3 * statistics.median(row[1] - quiet_cpu for row in logging_rows),
        "extra_wall": 1e3 * statistics.median(row[2] - quiet_wall for row in logging_rows),
        # The writer writes a step's events while the next steps run: the other threads' time over the fit.
        "other threads": 1e3 * sum(row[3] for row in kept) / len(logging_rows),
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
        f"/ {med('extra_wall'):.1f} | {med('other threads'):.1f} |"
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
    parser.add_argument("--floor", action="store_true", help="also time plain torch hooks (see the docstring)")
    parser.add_argument("--child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    parser.add_argument("--floor-of", choices=list(FLOORS.values()), help=argparse.SUPPRESS)
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
    floors = FLOORS if args.floor else {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*bases, *floors]}
    for _ in range(args.repeats):
        for name, base in bases.items():
            with base() as path:
                runs[name].append(child(args, path))
        for name, kind in floors.items():
            runs[name].append(child(args, None, kind))
    first = next(iter(runs.values()))[0]
    print(
        f"{time.strftime('%Y-%m-%d')}, {args.workload} ({first['parameters']} parameter tensors, {first['modules']} "
        f"modules), GradStats + ActivationStats every {args.every} steps, histograms "
        f"{'on' if args.histograms else 'off'}, {args.threads} thread(s), torch {torch.__version__}, lightning "
        f"{pl.__version__}, medians of {args.repeats} fits x {args.steps} steps; milliseconds\n"
    )
    print("| code | quiet step, CPU / wall | logging step's extra, CPU (× quiet) / wall | other threads |")
    print("|---|---:|---:|---:|")
    for name, found in runs.items():
        report(name, found)


if __name__ == "__main__":
    main()
