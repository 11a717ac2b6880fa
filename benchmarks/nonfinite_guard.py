"""Per-step cost of NonFiniteGuard at check_every_n_steps=1 against no guard and against detect_anomaly.

    .venv/bin/python benchmarks/nonfinite_guard.py [--repeats 7] [--steps 80]

The three variants run interleaved (none, guard, anomaly, none, ...) so that drifting machine
load hits all of them alike; each figure is the median over repeats of the per-step median
inside one Lightning fit, after ``--warmup`` steps. ``detect_anomaly`` is Lightning's
``Trainer(detect_anomaly=True)``. Two comparisons are printed: step time against no guard, and
the *extra* time per step of ``detect_anomaly`` against that of the guard.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import Variants, arguments, interleaved, machine, prepare  # noqa: E402

from lightning_hooks import NonFiniteGuard  # noqa: E402

VARIANTS: Variants = {
    "none": (lambda: [], {}),
    "NonFiniteGuard": (lambda: [NonFiniteGuard(check_every_n_steps=1)], {}),
    "detect_anomaly": (lambda: [], {"detect_anomaly": True}),
}


def main() -> None:
    args = arguments(__doc__, steps=80).parse_args()
    prepare(args)
    print(f"{machine()}, {args.repeats} repeats x {args.steps} steps (first {args.warmup} dropped)")
    with tempfile.TemporaryDirectory() as root:
        for workload in args.workloads:
            per_fit: dict[str, list[float]] = {name: [] for name in VARIANTS}
            # 50 is the Trainer's log_every_n_steps only; the guard checks every step.
            for name, times in interleaved(workload, VARIANTS, args.repeats, args.steps, 50, root):
                per_fit[name].append(statistics.median(t for s, t in times if s >= args.warmup))
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
