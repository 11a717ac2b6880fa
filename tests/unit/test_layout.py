"""The custom-scalars layout as a pure function of tag names."""

import re

import pytest
from torch import nn

from lightning_hooks.sinks.layout import MAX_LINES, STATISTICS, build_layout, chart_groups
from tests.support.zoo import ResNetish


def matches(layout: dict, tags: list[str]) -> dict[str, list[str]]:
    """Chart title -> the tags its regexes select, the way TensorBoard selects them (``re.match``)."""
    return {
        title: [t for t in tags if any(re.match(rx, t) for rx in regexes)]
        for charts in layout.values()
        for title, (_, regexes) in charts.items()
    }


def param_tags(model: nn.Module, stat: str) -> list[str]:
    return [f"{stat}/{name}" for name, _ in model.named_parameters()]


def test_small_model_gets_one_chart_per_statistic_with_every_layer() -> None:
    names = ["fc1.weight", "fc1.bias", "head.weight"]
    tags = [f"{s.prefix}/{n}" for s in STATISTICS for n in names] + ["grad_norm_total", "train_loss", "epoch"]
    layout = build_layout(tags)
    assert list(layout) == ["Gradients (parameters)", "Gradients (layer outputs)", "Activations", "Updates"]
    assert all(kind == "Multiline" for charts in layout.values() for kind, _ in charts.values())
    selected = matches(layout, tags)
    assert selected["total gradient L2 norm"] == ["grad_norm_total"]
    assert selected["gradient L2 norm by parameter"] == [f"grad_norm/{n}" for n in names]
    assert selected["output-gradient L2 norm by layer"] == [f"out_grad_norm/{n}" for n in names]
    assert selected["activation zero fraction by layer"] == [f"act_zero_frac/{n}" for n in names]
    # Every tag of a known statistic is on exactly one chart; the others on none.
    counts = {t: sum(t in chosen for chosen in selected.values()) for t in tags}
    assert counts == {t: 0 if t in ("train_loss", "epoch") else 1 for t in tags}


def test_only_statistics_that_were_logged_get_charts() -> None:
    layout = build_layout(["act_zero_frac/relu", "grad_clamp/clamped_fraction", "act_zero_frac/relu"])
    assert layout == {"Activations": {"activation zero fraction by layer": ("Multiline", ["^act_zero_frac/.+$"])}}
    assert build_layout([]) == {}
    assert build_layout(["loss", "grad_norm/", "lr-Adam"]) == {}


def deep_names(blocks: int = 12) -> list[str]:
    names = ["embed.weight"]
    for i in range(blocks):
        for part in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.0", "mlp.2", "norm1", "norm2"):
            names += [f"encoder.layers.{i}.{part}.weight", f"encoder.layers.{i}.{part}.bias"]
    return [*names, "head.weight", "head.bias"]


@pytest.mark.parametrize("blocks", [2, 12, 40])
def test_a_large_model_is_split_along_the_module_tree_into_charts_of_at_most_24_lines(blocks: int) -> None:
    names = deep_names(blocks)
    tags = [f"grad_norm/{n}" for n in names]
    charts = build_layout(tags)["Gradients (parameters)"]
    selected = matches({"c": charts}, tags)
    assert all(0 < len(chosen) <= MAX_LINES for chosen in selected.values())
    # A partition: every tag on exactly one chart, and charts follow model order.
    assert [t for chosen in selected.values() for t in chosen] == tags
    # Never more charts than needed to hold whole 16-parameter blocks at 24 lines each (one block per chart).
    assert len(charts) <= blocks + 2
    # Each chart holds whole blocks: the split is along module boundaries.
    for chosen in selected.values():
        blocks_in_chart = {t.split(".")[2] for t in chosen if t.startswith("grad_norm/encoder.")}
        for block in blocks_in_chart:
            assert sum(t.startswith(f"grad_norm/encoder.layers.{block}.") for t in chosen) == 16
    assert all(title.startswith("gradient L2 norm by parameter · ") for title in charts)


def test_a_real_model_with_many_parameters_is_split() -> None:
    tags = param_tags(ResNetish(), "grad_abs_max")
    tags += [f"grad_abs_max/extra{i}.weight" for i in range(30)]
    charts = build_layout(tags)["Gradients (parameters)"]
    selected = matches({"c": charts}, tags)
    assert len(charts) > 1
    assert sorted(t for chosen in selected.values() for t in chosen) == sorted(tags)
    assert max(len(chosen) for chosen in selected.values()) <= MAX_LINES


def test_names_are_escaped_and_a_layer_is_not_confused_with_its_nested_outputs() -> None:
    names = ["a", *(f"a.out.{i}" for i in range(5)), "b+c(1)", "b+c(1)x", "a1", *(f"z{i}" for i in range(20))]
    tags = [f"act_mean/{n}" for n in names]
    charts = build_layout(tags, max_lines=4)["Activations"]
    selected = matches({"c": charts}, [*tags, "act_mean/aXout.0", "act_mean/b+c(1)y"])
    chosen = [t for ts in selected.values() for t in ts]
    assert sorted(chosen) == sorted(tags)  # each exactly once; the look-alikes on no chart
    assert all(len(ts) <= 4 for ts in selected.values())


def test_chart_groups_is_none_when_one_chart_holds_everything() -> None:
    assert chart_groups(["x"] * 3, max_lines=3) is None
    assert chart_groups([f"m{i}" for i in range(5)], max_lines=2) == [
        ("m0 … m1", ["m0(?:\\..+)?", "m1(?:\\..+)?"]),
        ("m2 … m3", ["m2(?:\\..+)?", "m3(?:\\..+)?"]),
        ("m4", ["m4(?:\\..+)?"]),
    ]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_lines_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match=r"`build_layout` got `max_lines=.*`; `max_lines` must be a positive integer"):
        build_layout(["grad_norm/a"], max_lines=bad)  # type: ignore[arg-type]
