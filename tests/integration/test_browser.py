"""Headless Chromium shows TensorBoard's dashboards of a real digits run with charts drawn.

Needs Debian's ``chromium`` on PATH (``.ci/run`` installs it when it can); skipped with a message otherwise.
"""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.tb_server import DIGITS_RUN, Server, chromium, screenshot

pytestmark = pytest.mark.browser

HEADER = (245, 124, 0)
"""TensorBoard's orange app bar: the web app has started."""
RUN_COLOR = (255, 112, 67)
"""The colour TensorBoard gives the first (only) run: lines drawn from our data."""
TOOLBAR = (33, 150, 243)
"""The blue icons under every chart (full screen, log scale, fit domain)."""


def pixels_near(image: np.ndarray, color: tuple[int, int, int], tolerance: int = 8) -> int:
    return int((np.abs(image - np.array(color)).max(axis=-1) <= tolerance).sum())


@pytest.mark.parametrize(
    ("dashboard", "min_run_pixels"),
    [("scalars", 1000), ("custom_scalars", 3000)],
)
def test_chromium_screenshot_of_the_dashboard_shows_charts(
    tensorboard: Server, tmp_path: Path, dashboard: str, min_run_pixels: int
) -> None:
    if chromium() is None:
        pytest.skip("`chromium` is not on PATH; install Debian's chromium (`apt-get install -y chromium`) to run it")
    png = tmp_path / f"{dashboard}.png"
    result = screenshot(f"{tensorboard.url}/#{dashboard}", png, tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-3000:]
    assert png.stat().st_size > 30_000, f"suspiciously small screenshot {png}"
    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert image.shape == (1000, 1400, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 200, f"blank or nearly blank screenshot {png}"
    assert pixels_near(image[:50], HEADER) > 10_000, f"TensorBoard's web app did not render: {png}"
    main = image[120:, 360:]  # right of the sidebar, below the app bar and the filter box
    assert pixels_near(main, TOOLBAR) > 500, f"no charts on {png}"
    assert pixels_near(main, RUN_COLOR, tolerance=12) > min_run_pixels, f"charts without data lines on {png}"


def test_chromium_screenshot_of_the_text_tab_shows_the_memory_table(tensorboard: Server, tmp_path: Path) -> None:
    if chromium() is None:
        pytest.skip("`chromium` is not on PATH; install Debian's chromium (`apt-get install -y chromium`) to run it")
    # What the Text tab fetches for MemoryLogger's table: the summary line, then a markdown table of the modules.
    (entry,) = tensorboard.json("/data/plugin/text/text", run=DIGITS_RUN, tag="memory/train")
    assert [word for word in ("peak", "classifier.1", "Activations") if word not in entry["text"]] == []
    png = tmp_path / "text.png"
    result = screenshot(f"{tensorboard.url}/#text&tagFilter=memory", png, tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-3000:]
    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert pixels_near(image[:50], HEADER) > 10_000, f"TensorBoard's web app did not render: {png}"
    main = image[120:, 360:]
    dark = int((main.max(axis=-1) < 100).sum())  # the table's text
    assert dark > 5_000, f"no table text on {png} ({dark} dark pixels)"
