"""Per-step cost of NonFiniteGuard at check_every_n_steps=1 against no guard and against detect_anomaly.

    .venv/bin/python benchmarks/nonfinite_guard.py [--repeats 7] [--steps 80]

The three variants run interleaved (none, guard, anomaly, none, ...) so that drifting machine
load hits all of them alike; each figure is the median over repeats of the per-step median
inside one Lightning fit, after ``--warmup`` steps. ``detect_anomaly`` is Lightning's
``Trainer(detect_anomaly=True)``. Two comparisons are printed: step time against no guard, and
the *extra* time per step of ``detect_anomaly`` against that of the guard.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import WORKLOADS, Variant, quiet, run_once  # noqa: E402
from lightning_hooks import NonFiniteGuard  # noqa: E402

VARIANTS = [
    Variant("none"),
    Variant("NonFiniteGuard", lambda: [NonFiniteGuard(check_every_n_steps=1)]),
    Variant("detect_anomaly", trainer={"detect_anomaly": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workloads", nargs="*", default=["digits-cnn", "transformer"], choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} repeats x {args.steps} steps (first {args.warmup} dropped)"
    )
    with tempfile.TemporaryDirectory() as root:
        for workload in args.workloads:
            per_fit: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
            for _ in range(args.repeats):  # interleaved: none, guard, anomaly, none, ...
                for variant in VARIANTS:
                    times = run_once(workload, variant, args.steps, root)
                    per_fit[variant.name].append(statistics.median(t for s, t, _ in times if s >= args.warmup))
            ms = {name: statistics.median(values) * 1e3 for name, values in per_fit.items()}
            base = ms["none"]
            print(f"\n{workload}")
            print(f"{'variant':<16}{'ms/step':>9}{'x none':>9}{'extra ms':>10}")
            for name, value in ms.items():
                print(f"{name:<16}{value:>9.2f}{value / base:>9.2f}{value - base:>10.2f}")
            guard_extra = ms["NonFiniteGuard"] - base
            anomaly_extra = ms["detect_anomaly"] - base
            ratio = f"{anomaly_extra / guard_extra:.1f}x" if guard_extra > 0 else "n/a (guard within noise)"
            print(
                f"detect_anomaly / NonFiniteGuard: {ms['detect_anomaly'] / ms['NonFiniteGuard']:.2f}x the step time, "
                f"{ratio} the extra time per step"
            )


if __name__ == "__main__":
    main()
