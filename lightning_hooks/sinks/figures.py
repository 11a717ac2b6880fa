"""Figures of a logging step's per-layer statistics, drawn with matplotlib (an optional extra, imported on first use)
on the Agg canvas: no pyplot, no global state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from lightning_hooks.core.select import label
from lightning_hooks.stats.state import State, abs_mean, combine, derive

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "INSTALL_HINT",
    "gradient_flow_series",
    "render_gradient_flow",
    "render_zero_fraction",
    "require",
    "zero_fraction_series",
]

INSTALL_HINT = "`pip install matplotlib`, or the `plots` extra (`pip install '.[plots]'` in a clone)"

DEAD = 0.9
"""Zero fraction from which a layer's bar is drawn as dead."""

_MEAN_COLOR, _MAX_COLOR, _BAD_COLOR, _OK_COLOR = "#1f4e99", "#9dc3e6", "#c62828", "#4a90c8"


def gradient_flow_series(rows: Mapping[str, State]) -> tuple[list[str], list[float], list[float]]:
    """``(layers, mean_abs, max_abs)``: per module, in model order, mean and max ``|gradient|`` of its parameters
    from ``rows`` (qualified parameter name to state)."""
    pooled: dict[str, list[State]] = {}
    for name, row in rows.items():
        pooled.setdefault(label(name.rpartition(".")[0]), []).append(row)
    kept = {layer: row for layer, members in pooled.items() if (row := combine(members)).numel}
    return list(kept), [abs_mean(r) for r in kept.values()], [derive(r, ["abs_max"])["abs_max"] for r in kept.values()]


def zero_fraction_series(rows: Mapping[str, State]) -> tuple[list[str], list[float]]:
    """Per layer output, in call order, the share of exact zeros: ``(layers, zero_frac)``."""
    zero_frac = {name: stats["zero_frac"] for name, row in rows.items() if (stats := derive(row, ["zero_frac"]))}
    return list(zero_frac), list(zero_frac.values())


def render_gradient_flow(
    layers: Sequence[str], mean_abs: Sequence[float], max_abs: Sequence[float], step: int
) -> NDArray[np.uint8]:
    """The "gradient flow" bar chart on a log scale: per layer, max ``|g|`` behind mean ``|g|``; NaN/Inf and
    exactly zero gradients are marked."""
    figure, axes = _figure(len(layers))
    x = np.arange(len(layers))
    positive = [v for v in (*mean_abs, *max_abs) if math.isfinite(v) and v > 0]
    floor = min(positive) / 3 if positive else 1e-12
    top = max(positive) * 3 if positive else 1.0

    def bars(values: Sequence[float]) -> list[float]:
        return [v if math.isfinite(v) and v > 0 else floor for v in values]

    axes.bar(x, bars(max_abs), width=0.8, color=_MAX_COLOR, label="max |gradient|")
    axes.bar(x, bars(mean_abs), width=0.45, color=_MEAN_COLOR, label="mean |gradient|")
    axes.set_yscale("log")
    axes.set_ylim(floor, top)
    bad = [not (math.isfinite(a) and math.isfinite(b)) for a, b in zip(mean_abs, max_abs, strict=True)]
    above: dict[str, Any] = {"textcoords": "offset points", "ha": "center", "va": "bottom"}
    alarm: dict[str, Any] = {"color": _BAD_COLOR, "rotation": 90, "fontsize": 8, "fontweight": "bold"}
    for i, (is_bad, peak) in enumerate(zip(bad, max_abs, strict=True)):
        if is_bad:
            axes.annotate("NaN/Inf", (i, floor), xytext=(0, 4), **above, **alarm)
        elif peak == 0:
            axes.annotate("0", (i, floor), xytext=(0, 2), **above)
    return _finish(figure, axes, layers, bad, f"Gradient flow · step {step}", "|gradient| (log scale)")


def render_zero_fraction(layers: Sequence[str], zero_frac: Sequence[float], step: int) -> NDArray[np.uint8]:
    """Bars of each layer's activation zero fraction in call order; red from :data:`DEAD` (dead ReLUs) up."""
    figure, axes = _figure(len(layers))
    dead = [v >= DEAD for v in zero_frac]
    axes.bar(np.arange(len(layers)), zero_frac, width=0.7, color=[_BAD_COLOR if d else _OK_COLOR for d in dead])
    axes.axhline(DEAD, color=_BAD_COLOR, linestyle="--", linewidth=1, label=f"{DEAD:.0%}: mostly dead")
    axes.set_ylim(0, 1.05)
    axes.yaxis.set_major_formatter("{x:.0%}")
    return _finish(figure, axes, layers, dead, f"Activation zero fraction · step {step}", "share of exact zeros")


def require() -> None:
    """Import matplotlib now (it takes a while the first time); ImportError with the fix if it is missing."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as err:
        raise ImportError(f"The figures need matplotlib: {INSTALL_HINT}") from err


def _figure(n: int) -> tuple[Figure, Axes]:
    require()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(min(max(4 + 0.45 * n, 7), 24), 4.8), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.grid(axis="y", which="major", alpha=0.3)
    axes.set_axisbelow(True)
    return figure, axes


NAMED_MAX = 60
"""A figure's axis names at most about this many layers, plus every flagged one."""


def named_layers(flagged: Sequence[bool], most: int = NAMED_MAX) -> tuple[list[int], int]:
    """Which layers a figure's axis names: every ``k``-th so that at most about ``most`` are, and
    every flagged one; and ``k``.

    Example::

        >>> named_layers([False] * 5)
        ([0, 1, 2, 3, 4], 1)
        >>> named_layers([False] * 7 + [True], most=3)
        ([0, 3, 6, 7], 3)
    """
    every = max(1, math.ceil(len(flagged) / most))
    return [i for i, bad in enumerate(flagged) if bad or i % every == 0], every


def _finish(
    figure: Figure, axes: Axes, layers: Sequence[str], flagged: Sequence[bool], title: str, ylabel: str
) -> NDArray[np.uint8]:
    """Title, labels, legend and layer names (flagged ones in red); the figure's pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    axes.set_title(title, fontsize=11)
    axes.set_ylabel(ylabel)
    axes.set_xlim(-0.6, len(layers) - 0.4)
    shown, every = named_layers(flagged)
    axes.set_xticks(shown)
    axes.set_xticklabels([layers[i] for i in shown], rotation=45, ha="right", rotation_mode="anchor", fontsize=8)
    for tick, i in zip(axes.get_xticklabels(), shown, strict=True):
        if flagged[i]:
            tick.set_color(_BAD_COLOR)
    named = "" if every == 1 else f"; every {every}th named, and each flagged one"
    axes.set_xlabel(f"layer (model order{named})")
    axes.legend(loc="upper right", fontsize=8, framealpha=0.9)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
