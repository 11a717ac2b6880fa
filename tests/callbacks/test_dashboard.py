"""Custom-scalars layout and figures, written by real fits and read back with TensorBoard's own reader."""

import gc
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from tensorboard.plugins.custom_scalar import layout_pb2, metadata
from torch import nn
from torch.utils.tensorboard.summary import image as image_summary

from lightning_hooks import ActivationStats, GradStats
from lightning_hooks.sinks.backends import OPEN_CHARTS_MAX
from lightning_hooks.sinks.layout import STATISTICS
from tests.support.helpers import TinyNet, events, make_trainer

KNOWN = tuple(f"{s.prefix}/" for s in STATISTICS)


def layouts(root: Path) -> list[tuple[int, layout_pb2.Layout]]:
    """Every custom-scalars layout written to the run, with its step, as TensorBoard parses it."""
    written = []
    for event in events(root).Tensors(metadata.CONFIG_SUMMARY_TAG):
        layout = layout_pb2.Layout()
        layout.ParseFromString(event.tensor_proto.string_val[0])
        written.append((event.step, layout))
    return written


def charts_of(layout: layout_pb2.Layout) -> dict[str, list[str]]:
    return {f"{c.title}/{chart.title}": list(chart.multiline.tag) for c in layout.category for chart in c.chart}


def image_steps(root: Path, tag: str) -> list[int]:
    return [e.step for e in events(root).Images(tag)]


class LateLayer(TinyNet):
    """A TinyNet with a layer that joins the forward from step 2 on."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.late(out) if self.global_step >= 2 else out


class DeepNet(TinyNet):
    """A TinyNet with 16 small blocks between its layers: 38 parameters, more than one chart holds."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(16)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.act(self.fc1(x))))


def test_a_deep_model_gets_charts_split_by_module_with_at_most_24_lines_each(tmp_path: Path) -> None:
    make_trainer(tmp_path, [GradStats(output_grads=False, update_ratio=False)], max_steps=1).fit(DeepNet())
    charts = charts_of(layouts(tmp_path)[-1][1])
    tags = [t for t in events(tmp_path).Tags()["scalars"] if t.startswith("grad_norm/")]
    assert len(tags) == 36  # fc1, head and 16 blocks, weight and bias each (fc2 never runs)
    norm_charts = {title: rx for title, rx in charts.items() if "gradient L2 norm by parameter · " in title}
    assert len(norm_charts) >= 2
    on_chart = {title: [t for t in tags if any(re.match(r, t) for r in rx)] for title, rx in norm_charts.items()}
    assert sorted(t for chosen in on_chart.values() for t in chosen) == sorted(tags)
    assert all(0 < len(chosen) <= 24 for chosen in on_chart.values())


def test_one_layout_for_the_run_puts_every_logged_statistic_tag_on_exactly_one_chart(tmp_path: Path) -> None:
    callbacks = [GradStats(log_every_n_steps=2), ActivationStats(log_every_n_steps=2)]
    make_trainer(tmp_path, callbacks, max_steps=5).fit(TinyNet())
    written = layouts(tmp_path)
    assert [step for step, _ in written] == [0, 0]  # at the first logging step, once per callback: no re-writes
    final = written[-1][1]
    assert [c.title for c in final.category] == [
        "Gradients (parameters)",
        "Gradients (layer outputs)",
        "Activations",
        "Updates",
    ]
    charts = charts_of(final)
    assert charts["Activations/activation zero fraction by layer"] == ["^act_zero_frac/.+$"]
    tags = events(tmp_path).Tags()["scalars"]
    for tag in tags:
        on = [title for title, regexes in charts.items() if any(re.match(rx, tag) for rx in regexes)]
        expected = 1 if tag.startswith(KNOWN) or tag == "grad_norm_total" else 0
        assert len(on) == expected, (tag, on)


def test_the_layout_is_written_again_when_new_tags_appear(tmp_path: Path) -> None:
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1, output_grads=False)], max_steps=4).fit(LateLayer())
    assert [step for step, _ in layouts(tmp_path)] == [0, 2]
    assert "grad_norm/late.weight" in events(tmp_path).Tags()["scalars"]


def test_a_second_fit_with_a_new_logger_gets_the_layout_too(tmp_path: Path) -> None:
    # The sink knows the tags from the first fit: a new run must still get its layout.
    callback = GradStats(log_every_n_steps=1)
    for run in ("first", "second"):
        make_trainer(tmp_path / run, [callback], max_steps=2).fit(TinyNet())
        assert [step for step, _ in layouts(tmp_path / run)] == [0]


@pytest.mark.parametrize(
    ("log_every", "figure_every", "max_steps", "expected"),
    [(2, 4, 9, [0, 4, 8]), (1, None, 12, [0, 10]), (2, 2, 5, [0, 2, 4])],
)
def test_figures_are_drawn_on_logging_steps_that_are_multiples_of_the_figure_period(
    tmp_path: Path, log_every: int, figure_every: int | None, max_steps: int, expected: list[int]
) -> None:
    callbacks = [
        GradStats(log_every_n_steps=log_every, figure_every_n_steps=figure_every),
        ActivationStats(log_every_n_steps=log_every, figure_every_n_steps=figure_every),
    ]
    make_trainer(tmp_path, callbacks, max_steps=max_steps).fit(TinyNet())
    assert image_steps(tmp_path, "figures/gradient_flow") == expected
    assert image_steps(tmp_path, "figures/activation_zero_frac") == expected
    image = events(tmp_path).Images("figures/gradient_flow")[0]
    assert image.encoded_image_string.startswith(b"\x89PNG")
    assert image.width >= 600
    assert image.height >= 400


def test_a_figure_is_written_as_tensorboards_own_add_image_writes_it(tmp_path: Path) -> None:
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1)], max_steps=1).fit(TinyNet())
    [written] = events(tmp_path).Images("figures/gradient_flow")
    pixels = np.asarray(Image.open(io.BytesIO(written.encoded_image_string)))
    assert pixels.dtype == np.uint8
    assert pixels.shape == (written.height, written.width, 3)
    [expected] = image_summary("figures/gradient_flow", pixels, dataformats="HWC").value
    assert written.encoded_image_string == expected.image.encoded_image_string
    assert (written.height, written.width) == (expected.image.height, expected.image.width)


def test_a_drawn_figure_is_collected_before_training_goes_on(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    make_trainer(tmp_path, [GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)], max_steps=1).fit(
        TinyNet()
    )
    assert image_steps(tmp_path, "figures/gradient_flow") == [0]
    # gc.get_objects() lists cycles nobody collected yet: a figure's artists would wait there, holding memory
    assert [o for o in gc.get_objects() if isinstance(o, Figure)] == []


def test_default_figures_stay_within_their_time_share_and_the_last_skipped_one_is_drawn_at_the_end(
    tmp_path: Path,
) -> None:
    # TinyNet's 31 steps take far less than 99 times one figure's drawing time, so after the figure
    # at step 0 the default period's figures at 10, 20 and 30 are skipped, and 30 is drawn when
    # training ends; an explicit period is followed exactly.
    callbacks = [GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1, figure_every_n_steps=10)]
    make_trainer(tmp_path, callbacks, max_steps=31).fit(TinyNet())
    assert image_steps(tmp_path, "figures/gradient_flow") == [0, 30]
    assert image_steps(tmp_path, "figures/activation_zero_frac") == [0, 10, 20, 30]


def test_a_figure_period_that_is_not_a_multiple_of_the_logging_period_warns_and_uses_both(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"`ActivationStats` got `figure_every_n_steps=3`.*so every 6 steps"):
        make_trainer(tmp_path, [ActivationStats(log_every_n_steps=2, figure_every_n_steps=3)], max_steps=13).fit(
            TinyNet()
        )
    assert image_steps(tmp_path, "figures/activation_zero_frac") == [0, 6, 12]


@pytest.mark.usefixtures("no_matplotlib")
def test_without_matplotlib_training_goes_on_with_one_warning_per_callback(tmp_path: Path) -> None:
    callbacks = [GradStats(figure_every_n_steps=1), ActivationStats(figure_every_n_steps=1)]
    with pytest.warns(UserWarning, match=re.escape("`pip install matplotlib`, or the `plots` extra")) as record:
        make_trainer(tmp_path, callbacks, max_steps=4, log_every_n_steps=1).fit(TinyNet())
    messages = [str(w.message) for w in record if "matplotlib" in str(w.message)]
    assert len(messages) == 2
    assert any(m.startswith("`GradStats` draws its figures with matplotlib, which is not installed") for m in messages)
    tags = events(tmp_path).Tags()
    assert tags["images"] == []
    assert {"grad_norm/fc1.weight", "act_zero_frac/act"} <= set(tags["scalars"])
    assert metadata.CONFIG_SUMMARY_TAG in tags["tensors"]


@pytest.mark.usefixtures("no_matplotlib")
def test_without_matplotlib_figures_nobody_asked_for_are_skipped_without_a_word(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    make_trainer(tmp_path, [GradStats(), ActivationStats()], max_steps=11, log_every_n_steps=1).fit(TinyNet())
    assert not [str(w.message) for w in recwarn if "matplotlib" in str(w.message)]
    assert {"grad_norm/fc1.weight", "act_zero_frac/act"} <= set(events(tmp_path).Tags()["scalars"])


@pytest.mark.usefixtures("no_matplotlib")
def test_without_matplotlib_figures_asked_for_with_figures_true_are_warned_about_once(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=re.escape("`pip install matplotlib`, or the `plots` extra")) as record:
        make_trainer(tmp_path, [GradStats(figures=True)], max_steps=11, log_every_n_steps=1).fit(TinyNet())
    assert sum("matplotlib" in str(w.message) for w in record) == 1


def test_other_loggers_get_no_layout_and_one_warning_about_figures_that_were_asked_for(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path, [GradStats(figure_every_n_steps=1)], logger=False, max_steps=3, log_every_n_steps=1
    )
    trainer.loggers = [CSVLogger(tmp_path, name="csv")]
    with pytest.warns(UserWarning, match="`GradStats` logs figures to TensorBoard, W&B and MLflow") as record:
        trainer.fit(TinyNet())
    assert sum("logs figures to" in str(w.message) for w in record) == 1


def test_other_loggers_get_no_warning_about_default_figures(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    trainer = make_trainer(tmp_path, [GradStats(), ActivationStats()], logger=False, max_steps=3, log_every_n_steps=1)
    trainer.loggers = [CSVLogger(tmp_path, name="csv")]
    trainer.fit(TinyNet())
    assert not [str(w.message) for w in recwarn if "logs figures to" in str(w.message)]
    assert "act_zero_frac/act" in next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0]


@pytest.mark.parametrize("callback", [GradStats, ActivationStats])
@pytest.mark.parametrize("bad", [0, -10, 2.5, True, "10"])
def test_figure_period_must_be_a_positive_integer(callback: Any, bad: object) -> None:
    name = callback.__name__
    match = (
        rf"`{name}` got `figure_every_n_steps={re.escape(repr(bad))}`; `figure_every_n_steps` must be a positive "
        r"integer or None \(10 × the logging period\)\."
    )
    with pytest.raises(ValueError, match=match):
        callback(figure_every_n_steps=bad)


def test_figures_false_draws_no_figure_and_logs_everything_else(tmp_path: Path) -> None:
    callbacks = [
        GradStats(log_every_n_steps=1, figures=False),
        ActivationStats(log_every_n_steps=1, figures=False),
    ]
    make_trainer(tmp_path, callbacks, max_steps=3).fit(TinyNet())
    tags = events(tmp_path).Tags()
    assert tags["images"] == []
    assert "grad_norm_total" in tags["scalars"]
    assert "act_mean/fc1" in tags["scalars"]


def test_a_figure_period_with_figures_false_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`GradStats` got `figure_every_n_steps=5` with `figures=False`"):
        GradStats(figures=False, figure_every_n_steps=5)
    with pytest.raises(TypeError, match=r"`ActivationStats` got `figures='no'`"):
        ActivationStats(figures="no")  # type: ignore[arg-type]


def test_categories_with_many_charts_start_closed_and_small_ones_open(tmp_path: Path) -> None:
    make_trainer(tmp_path / "deep", [GradStats(output_grads=False, update_ratio=False)], max_steps=1).fit(DeepNet())
    make_trainer(tmp_path / "tiny", [GradStats(output_grads=False, update_ratio=False)], max_steps=1).fit(TinyNet())
    deep, tiny = layouts(tmp_path / "deep")[-1][1], layouts(tmp_path / "tiny")[-1][1]
    assert [(c.title, len(c.chart) > OPEN_CHARTS_MAX, c.closed) for c in deep.category] == [
        ("Gradients (parameters)", True, True)
    ]
    assert [(c.title, c.closed) for c in tiny.category] == [("Gradients (parameters)", False)]
