"""A real `tensorboard` server, started on a real digits run, serves our tags, values, figures and tables.

The server is a subprocess on 127.0.0.1 (see ``tests/support/tb_server.py``); everything is asked of its
HTTP data API, the one TensorBoard's own web app uses, and compared with the event file read by
TensorBoard's ``EventAccumulator``.
"""

import re
import struct
from pathlib import Path

import pytest

from tests.support.helpers import events
from tests.support.tb_server import DIGITS_RUN, Server, tensorboard_server

PARAMS = [
    "features.0.weight",
    "features.0.bias",
    "features.1.weight",
    "features.1.bias",
    "features.3.weight",
    "features.3.bias",
    "classifier.1.weight",
    "classifier.1.bias",
    "classifier.3.weight",
    "classifier.3.bias",
]


def test_the_server_lists_our_plugins_and_every_tag_the_event_file_holds(
    tensorboard: Server, digits_logs: Path
) -> None:
    plugins = tensorboard.json("/data/plugins_listing")
    for plugin in ("scalars", "custom_scalars", "images", "histograms", "text"):
        assert plugins[plugin]["enabled"], plugin
    on_disk = events(digits_logs).Tags()

    scalar_tags = set(tensorboard.json("/data/plugin/scalars/tags")[DIGITS_RUN])
    assert scalar_tags == set(on_disk["scalars"])
    ours = {"grad_norm_total", "grad_clamp/clamped_fraction", "out_grad_norm/classifier.3", "act_zero_frac/features.2"}
    ours |= {f"{stat}/{p}" for stat in ("grad_norm", "grad_abs_max", "update_ratio") for p in PARAMS}
    assert ours <= scalar_tags

    histogram_tags = set(tensorboard.json("/data/plugin/histograms/tags")[DIGITS_RUN])
    assert histogram_tags == set(on_disk["histograms"])
    assert {"grad/features.0.weight", "act/features.0", "act/classifier.3"} <= histogram_tags

    image_tags = tensorboard.json("/data/plugin/images/tags")[DIGITS_RUN]
    assert set(image_tags) == {"figures/gradient_flow", "figures/activation_zero_frac"}
    assert sorted(tensorboard.json("/data/plugin/text/tags")[DIGITS_RUN]) == ["memory/train", "shapes/train"]


def test_a_scalar_series_is_exactly_what_the_event_file_holds(tensorboard: Server, digits_logs: Path) -> None:
    for tag in ("grad_norm_total", "act_zero_frac/features.2"):
        served = tensorboard.json("/data/plugin/scalars/scalars", run=DIGITS_RUN, tag=tag)
        on_disk = [(e.step, e.value) for e in events(digits_logs).Scalars(tag)]
        assert [(step, value) for _, step, value in served] == on_disk
        assert [step for step, _ in on_disk] == list(range(0, 24, 2))
        assert all(value > 0 for _, value in on_disk)


def test_the_custom_scalars_layout_puts_every_layer_of_a_statistic_on_one_chart(tensorboard: Server) -> None:
    layout = tensorboard.json("/data/plugin/custom_scalars/layout")
    charts = {
        (c["title"], chart["title"]): chart["multiline"]["tag"] for c in layout["category"] for chart in c["chart"]
    }
    assert [c["title"] for c in layout["category"]] == [
        "Gradients (parameters)",
        "Gradients (layer outputs)",
        "Activations",
        "Updates",
    ]
    regexes = charts[("Gradients (parameters)", "gradient L2 norm by parameter")]
    # What the Custom Scalars tab draws on that chart, asked the way its web app asks.
    payload = {}
    for regex in regexes:
        answer = tensorboard.json("/data/plugin/custom_scalars/scalars", run=DIGITS_RUN, tag=regex)
        assert answer["regex_valid"]
        payload.update(answer["tag_to_events"])
    assert sorted(payload) == sorted(f"grad_norm/{p}" for p in PARAMS)
    assert all(len(series) == 12 for series in payload.values())

    zero_frac = charts[("Activations", "activation zero fraction by layer")]
    answer = tensorboard.json("/data/plugin/custom_scalars/scalars", run=DIGITS_RUN, tag=zero_frac[0])
    assert {"act_zero_frac/features.2", "act_zero_frac/features.4", "act_zero_frac/classifier.2"} <= set(
        answer["tag_to_events"]
    )


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_figures_are_served_as_png_images(tensorboard: Server) -> None:
    for tag in ("figures/gradient_flow", "figures/activation_zero_frac"):
        entries = tensorboard.json("/data/plugin/images/images", run=DIGITS_RUN, tag=tag)
        assert [e["step"] for e in entries] == [0, 20]
        width, height = png_size(tensorboard.get(f"/data/plugin/images/individualImage?{entries[-1]['query']}"))
        assert width >= 600
        assert height >= 400


def test_the_shape_table_renders_as_an_html_table_with_a_short_header(tensorboard: Server) -> None:
    entries = tensorboard.json("/data/plugin/text/text", run=DIGITS_RUN, tag="shapes/train")
    first = entries[0]
    assert first["step"] == 0
    html = first["text"]
    assert re.match(r"<p><strong>DigitsCNN · step 0 · batch .*\[64, 1, 8, 8\].*</strong></p>", html)
    assert html.count("<table>") == 1  # the markdown table itself, not framed in another one
    assert "<th>Layer</th>" in html
    assert "<td>features.0</td>\n<td>Conv2d</td>" in html


def test_the_server_is_stopped_even_when_the_block_fails(digits_logs: Path, tmp_path: Path) -> None:
    running: list[bool] = []
    servers: list[Server] = []

    def use_and_fail() -> None:
        with tensorboard_server(digits_logs, tmp_path) as server:
            servers.append(server)
            running.append(server.process.poll() is None)
            raise RuntimeError("planned")

    with pytest.raises(RuntimeError, match="planned"):
        use_and_fail()
    assert running == [True]
    assert servers[0].process.poll() is not None
