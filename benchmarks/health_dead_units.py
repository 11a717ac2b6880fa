"""Host time of HealthMonitor's dead-units check on a logging step of GPT-2 small: 96 layers whose outputs have 768,
2,304 or 3,072 units (about 150 k units), 6 logging steps; the median of the last 4 (a window of 3 is full by then).

    .venv/bin/python benchmarks/health_dead_units.py
"""

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_hooks.diagnose.checks import Snapshot, Thresholds  # noqa: E402
from lightning_hooks.diagnose.health import HealthTracker  # noqa: E402
from lightning_hooks.stats.state import State  # noqa: E402

OUTPUTS = (("ln_1", 768), ("attn.c_attn", 2304), ("attn.c_proj", 768), ("ln_2", 768), ("mlp.c_fc", 3072))
OUTPUTS += (("mlp.act", 3072), ("mlp.c_proj", 768), ("mlp.dropout", 768))


def main() -> None:
    random.seed(0)
    widths = [(f"h.{layer}.{name}", units) for layer in range(12) for name, units in OUTPUTS]
    tracker = HealthTracker(["dead_units"], Thresholds())
    times = []
    for step in range(6):
        # one unit in 97 silent (a healthy model's few), each unit seen by 4,096 samples
        units = {n: [0.0 if i % 97 == 0 else random.random() + 0.1 for i in range(w)] for n, w in widths}
        snap = Snapshot(
            step=50 * step,
            order=[n for n, _ in widths],
            activations={n: State(numel=4096.0 * w) for n, w in widths},
            units=units,
        )
        start = time.perf_counter()
        tracker.update(snap)
        times.append(time.perf_counter() - start)
    print(f"dead units check: {1e3 * statistics.median(times[2:]):.1f} ms per logging step")


if __name__ == "__main__":
    main()
