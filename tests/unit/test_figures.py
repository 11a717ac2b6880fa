"""The figure series (pure) and renderers (real matplotlib, Agg)."""

import math
import re

import numpy as np
import pytest
import torch

from lightning_hooks.sinks.figures import (
    INSTALL_HINT,
    NAMED_MAX,
    gradient_flow_series,
    named_layers,
    render_gradient_flow,
    render_zero_fraction,
    zero_fraction_series,
)
from lightning_hooks.stats.state import State, abs_mean, state


def rows(tensors: dict[str, torch.Tensor]) -> dict[str, State]:
    return {name: state(t) for name, t in tensors.items()}


def test_abs_mean_of_combined_moments_is_the_mean_absolute_value() -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)) - 0.3
    assert abs_mean(state(t)) == pytest.approx(float(t.abs().double().mean()), rel=1e-6)
    assert math.isnan(abs_mean(state(torch.zeros(0))))


def test_gradient_flow_pools_a_modules_parameters_in_model_order() -> None:
    generator = torch.Generator().manual_seed(1)
    grads = {
        "features.0.weight": torch.randn(16, 1, 3, 3, generator=generator),
        "features.0.bias": torch.randn(16, generator=generator) * 10,
        "classifier.3.weight": torch.randn(10, 64, generator=generator) * 1e-4,
        "scale": torch.tensor([-2.0]),
    }
    layers, mean_abs, max_abs = gradient_flow_series(rows(grads))
    assert layers == ["features.0", "classifier.3", "root"]
    conv = torch.cat([grads["features.0.weight"].flatten(), grads["features.0.bias"]]).abs().double()
    assert mean_abs[0] == pytest.approx(float(conv.mean()), rel=1e-6)
    assert max_abs[0] == pytest.approx(float(conv.max()), rel=1e-6)
    assert mean_abs[1] == pytest.approx(float(grads["classifier.3.weight"].abs().double().mean()), rel=1e-6)
    assert (mean_abs[2], max_abs[2]) == (2.0, 2.0)


def test_zero_fraction_series_keeps_call_order_and_skips_empty_outputs() -> None:
    acts = {"conv": torch.randn(100), "relu": torch.relu(torch.linspace(-1, 1, 101)), "empty": torch.zeros(0)}
    layers, values = zero_fraction_series(rows(acts))
    assert layers == ["conv", "relu"]
    assert values == [0.0, pytest.approx(float((acts["relu"] == 0).double().mean()))]
    assert 0.45 < values[1] < 0.55


def assert_picture(image: np.ndarray) -> None:
    assert image.dtype == np.uint8
    assert image.ndim == 3
    assert image.shape[2] == 3
    assert image.shape[0] >= 400
    assert image.shape[1] >= 600
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 20  # drawn, not a blank canvas


def test_renderers_return_rgb_pictures_and_survive_zeros_and_nonfinite_values() -> None:
    layers = ["features.0", "features.1", "features.3", "classifier.1", "classifier.3", "root"]
    image = render_gradient_flow(
        layers, [1e-3, 5e-4, 0.0, 1e-5, 2e-3, math.nan], [1e-2, 3e-3, 0.0, 1e-4, 1e-2, math.inf], 7
    )
    assert_picture(image)
    assert_picture(render_zero_fraction(["a", "b", "c"], [0.0, 0.5, 0.97], 7))
    # All-zero gradients (nothing positive to put on a log axis) still draw.
    assert_picture(render_gradient_flow(["a"], [0.0], [0.0], 0))


def test_many_layers_widen_the_figure_up_to_a_limit() -> None:
    narrow = render_zero_fraction([f"l{i}" for i in range(3)], [0.1] * 3, 0)
    wide = render_zero_fraction([f"layer.{i}" for i in range(30)], [0.1] * 30, 0)
    huge = render_zero_fraction([f"layer.{i}" for i in range(300)], [0.1] * 300, 0)
    assert narrow.shape[1] < wide.shape[1] <= huge.shape[1] <= 2400


@pytest.mark.usefixtures("no_matplotlib")
def test_without_matplotlib_the_renderers_say_how_to_install_it() -> None:
    with pytest.raises(ImportError, match=re.escape(f"The figures need matplotlib: {INSTALL_HINT}")):
        render_zero_fraction(["a"], [0.5], 0)


@pytest.mark.parametrize(("count", "flagged_at"), [(24, []), (400, []), (400, [7, 133])])
def test_a_long_axis_names_every_kth_layer_and_every_flagged_one(count: int, flagged_at: list[int]) -> None:
    flagged = [i in flagged_at for i in range(count)]
    shown, every = named_layers(flagged)
    assert len(shown) <= NAMED_MAX + len(flagged_at)
    assert set(flagged_at) <= set(shown)
    assert shown[0] == 0
    assert all(b - a <= every for a, b in zip(shown, shown[1:], strict=False))
    assert every == (1 if count <= NAMED_MAX else -(-count // NAMED_MAX))
