"""A TensorBoard custom-scalars layout built from the tags the statistics callbacks logged (pure Python)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["build_layout"]

MAX_LINES = 24
"""The most lines one chart may have."""

Chart = tuple[str, list[str]]
"""``("Multiline", [regex])``: one chart of the layout."""

Layout = dict[str, dict[str, Chart]]
"""``{category: {chart title: chart}}``, in display order."""


@dataclass(frozen=True)
class Statistic:
    """A per-layer statistic: tags ``<prefix>/<name>``, drawn on charts titled ``<title> by <by>``."""

    prefix: str
    category: str
    title: str
    by: str


GRADIENTS = "Gradients (parameters)"
OUTPUT_GRADIENTS = "Gradients (layer outputs)"
ACTIVATIONS = "Activations"
UPDATES = "Updates"

STATISTICS: tuple[Statistic, ...] = (
    Statistic("grad_norm", GRADIENTS, "gradient L2 norm", "parameter"),
    Statistic("grad_abs_max", GRADIENTS, "gradient max |g|", "parameter"),
    Statistic("grad_mean", GRADIENTS, "gradient mean", "parameter"),
    Statistic("grad_std", GRADIENTS, "gradient std", "parameter"),
    Statistic("grad_zero_frac", GRADIENTS, "gradient zero fraction", "parameter"),
    Statistic("grad_nonfinite", GRADIENTS, "gradient NaN/Inf count", "parameter"),
    Statistic("out_grad_norm", OUTPUT_GRADIENTS, "output-gradient L2 norm", "layer"),
    Statistic("out_grad_abs_max", OUTPUT_GRADIENTS, "output-gradient max |g|", "layer"),
    Statistic("out_grad_nonfinite", OUTPUT_GRADIENTS, "output-gradient NaN/Inf count", "layer"),
    Statistic("act_zero_frac", ACTIVATIONS, "activation zero fraction", "layer"),
    Statistic("act_abs_max", ACTIVATIONS, "activation max |a|", "layer"),
    Statistic("act_mean", ACTIVATIONS, "activation mean", "layer"),
    Statistic("act_std", ACTIVATIONS, "activation std", "layer"),
    Statistic("act_nonfinite", ACTIVATIONS, "activation NaN/Inf count", "layer"),
    Statistic("update_ratio", UPDATES, "update ratio ||Δw|| / ||w||", "parameter"),
)
"""Every per-layer statistic, in display order: categories appear in the order of their first statistic."""

TOTALS: dict[str, tuple[str, str]] = {"grad_norm_total": (GRADIENTS, "total gradient L2 norm")}
"""Single tags that get a chart of their own: ``{tag: (category, title)}``."""


def build_layout(tags: Iterable[str], max_lines: int = MAX_LINES) -> Layout:
    """The mapping ``custom_scalars`` takes for ``tags`` (in model order): per statistic, a chart of every layer,
    split along the module tree past ``max_lines`` lines (:func:`chart_groups`); other tags are ignored.

    Example::

        >>> layout = build_layout(["grad_norm/fc.weight", "grad_norm/fc.bias", "grad_norm_total", "loss"])
        >>> for category, charts in layout.items():
        ...     for title, (kind, regexes) in charts.items():
        ...         print(f"{category} | {title} | {kind} {regexes}")
        Gradients (parameters) | total gradient L2 norm | Multiline ['^grad_norm_total$']
        Gradients (parameters) | gradient L2 norm by parameter | Multiline ['^grad_norm/.+$']
    """
    if isinstance(max_lines, bool) or not isinstance(max_lines, int) or max_lines < 1:
        raise ValueError(f"`build_layout` got `max_lines={max_lines!r}`; `max_lines` must be a positive integer.")
    names: dict[str, dict[str, None]] = {}
    totals: list[str] = []
    for tag in tags:
        prefix, sep, name = tag.partition("/")
        if sep and name:
            names.setdefault(prefix, {})[name] = None
        elif not sep and tag in TOTALS:
            totals.append(tag)
    layout: Layout = {}
    for tag in dict.fromkeys(totals):
        category, title = TOTALS[tag]
        layout.setdefault(category, {})[title] = ("Multiline", [f"^{re.escape(tag)}$"])
    for stat in STATISTICS:
        if stat.prefix not in names:
            continue
        charts = layout.setdefault(stat.category, {})
        groups = chart_groups(list(names[stat.prefix]), max_lines)
        base = f"{stat.title} by {stat.by}"
        if groups is None:
            charts[base] = ("Multiline", [f"^{re.escape(stat.prefix)}/.+$"])
            continue
        for title, patterns in groups:
            charts[f"{base} · {title}"] = ("Multiline", [f"^{re.escape(stat.prefix)}/(?:{'|'.join(patterns)})$"])
    return layout


def chart_groups(names: Sequence[str], max_lines: int = MAX_LINES) -> list[tuple[str, list[str]]] | None:
    """How to split ``names`` into charts of at most ``max_lines`` lines; ``None`` when one chart holds them all.

    Names are grouped by their first dotted components, at the smallest depth where every group fits,
    and consecutive groups packed into charts: ``(title, one escaped regex per group)``.

    Example::

        >>> names = [f"blocks.{i}.{p}" for i in range(3) for p in ("weight", "bias")]
        >>> for title, patterns in chart_groups(names, max_lines=4):
        ...     print(title, "|", " ".join(patterns))
        blocks.0 … blocks.1 | blocks\\.0(?:\\..+)? blocks\\.1(?:\\..+)?
        blocks.2 | blocks\\.2(?:\\..+)?
    """
    if len(names) <= max_lines:
        return None
    parts = {name: name.split(".") for name in names}
    for depth in range(1, max(len(p) for p in parts.values()) + 1):
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(".".join(parts[name][:depth]), []).append(name)
        if max(len(members) for members in groups.values()) <= max_lines:
            break
    # At the deepest depth every name is a group of its own, so the loop always ends on a fitting split.
    charts: list[tuple[str, list[str]]] = []
    keys: list[str] = []
    lines = 0
    for key, members in groups.items():
        if keys and lines + len(members) > max_lines:
            charts.append(_chart(keys, depth))
            keys, lines = [], 0
        keys.append(key)
        lines += len(members)
    charts.append(_chart(keys, depth))
    return charts


def _chart(keys: list[str], depth: int) -> tuple[str, list[str]]:
    # A key of `depth` components stands for itself and everything below it; a shorter one only for itself.
    patterns = [re.escape(k) + (r"(?:\..+)?" if k.count(".") + 1 == depth else "") for k in keys]
    return (keys[0] if len(keys) == 1 else f"{keys[0]} … {keys[-1]}"), patterns
