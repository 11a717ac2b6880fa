"""Regenerate the README's TensorBoard pictures from a full run of configs/digits.yaml.

    make screenshot            # or: python -m docs.screenshot  (from the repository root)

Trains the digits job (all callbacks, 8 epochs, about a minute on 2 cores) into a temporary
folder, starts the real ``tensorboard`` on 127.0.0.1, and has headless Chromium (Debian's
``chromium``) screenshot the Scalars and Custom Scalars dashboards; the last gradient-flow and
zero-fraction figures are fetched from the same server. Then the digits CNN at a learning rate
100x too large, watched by ``HealthMonitor``, for the Text tab's ``health/findings`` table.
Writes ``docs/*.png``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks.health import Case, run
from examples.digits import DigitsCNN, DigitsDataModule
from tests.support.tb_server import DIGITS_RUN, chromium, screenshot, tensorboard_server, train_digits, wait_for_run

DOCS = Path(__file__).parent
DASHBOARDS = {
    "tensorboard-scalars.png": "scalars",
    "tensorboard-custom-scalars.png": "custom_scalars",
}
HEALTH = Case("digits_lr_x100", lambda: (DigitsCNN(lr=1.0), DigitsDataModule()), 100)
"""A run with findings to show: the digits CNN under Adam at a learning rate 100x its own."""
FIGURES = {
    "gradient-flow.png": "figures/gradient_flow",
    "activation-zero-frac.png": "figures/activation_zero_frac",
}


def main() -> int:
    if chromium() is None:
        print("`chromium` is not on PATH; install it first (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="lightning-hooks-screenshot-") as tmp:
        work = Path(tmp)
        train_digits(work / "logs")
        with tensorboard_server(work / "logs", work) as server:
            wait_for_run(server, DIGITS_RUN, {"grad_norm_total", "act_zero_frac/features.2"})
            for name, dashboard in DASHBOARDS.items():
                result = screenshot(f"{server.url}/#{dashboard}", DOCS / name, work / "profile")
                if result.returncode:
                    print(result.stderr, file=sys.stderr)
                    return result.returncode
                print(f"wrote {DOCS / name}")
            for name, tag in FIGURES.items():
                last = server.json("/data/plugin/images/images", run=DIGITS_RUN, tag=tag)[-1]
                (DOCS / name).write_bytes(server.get(f"/data/plugin/images/individualImage?{last['query']}"))
                print(f"wrote {DOCS / name} (step {last['step']})")
        findings = run(HEALTH, str(work / "health"))
        print(f"{len(findings)} health finding(s): {', '.join(sorted({f.check for f in findings}))}")
        with tensorboard_server(work / "health", work) as server:
            wait_for_run(server, f"{HEALTH.name}/version_0", {"health/dead_units"})
            png = DOCS / "health-findings.png"
            result = screenshot(f"{server.url}/#text", png, work / "profile", size=(1400, 700))
            if result.returncode:
                print(result.stderr, file=sys.stderr)
                return result.returncode
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
