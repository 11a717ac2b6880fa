"""Per-tensor statistics computed on the tensor's device and brought to the host in one transfer.

Each tensor is reduced to a small row of *moments* (count, sum, sum of squares, abs-max, zeros,
non-finite count) that combine exactly across calls of the same module, micro-batches and ranks;
the statistics users see (norm, mean, std, ...) are derived from the combined row on the host.
Histograms are counted on device too, from a bounded strided sample, so a large tensor costs
little and nothing but the counts crosses to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

STATS = ("norm", "mean", "std", "abs_max", "zero_frac", "nonfinite")
"""Every statistic a row can give."""

Key = tuple[str, str]
"""``(group, name)``: what a row is of, e.g. ``("param", "fc1.weight")``."""

_COUNT, _SUM, _SUMSQ, _ABS_MAX, _ZEROS, _NONFINITE, _ABS_SUM = range(7)
MOMENT_WIDTH = 7
HIST_SAMPLE = 1 << 16
"""Histograms count at most this many elements of a tensor (an even stride through it)."""


def moments(t: torch.Tensor) -> torch.Tensor:
    """A float64 row ``[count, sum, sum_sq, abs_max, zeros, nonfinite, abs_sum]`` on ``t``'s device.

    ``sum`` and ``sum_sq`` are rebuilt from the float32 mean and (population) variance, which
    torch computes accurately, so that rows of different tensors add up exactly.
    """
    x = t.detach()
    if not x.is_floating_point():
        x = x.float()
    n = x.numel()
    if n == 0:
        return torch.zeros(MOMENT_WIDTH, dtype=torch.float64, device=x.device)
    xf = x.float()
    var, mean = torch.var_mean(xf, correction=0)
    mean64, var64 = mean.double(), var.double()
    return torch.stack(
        [
            torch.tensor(float(n), dtype=torch.float64, device=x.device),
            mean64 * n,
            (var64 + mean64 * mean64) * n,
            xf.abs().amax().double(),
            (xf == 0).sum().double(),
            (~torch.isfinite(xf)).sum().double(),
            xf.abs().sum().double(),  # abs_sum: the mean |x| of the gradient-flow figure
        ]
    )


def combine(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """One moment row for several: sums add, the abs-max is the largest."""
    if len(rows) == 1:
        return rows[0]
    stacked = torch.stack(list(rows))
    out = stacked.sum(dim=0)
    out[_ABS_MAX] = stacked[:, _ABS_MAX].amax()
    return out


def derive(row: Sequence[float], stats: Sequence[str] = STATS) -> dict[str, float]:
    """The named statistics of a combined moment row (on the host)."""
    n = row[_COUNT]
    if n == 0:
        return {}
    mean = row[_SUM] / n
    values = {
        "norm": math.sqrt(max(row[_SUMSQ], 0.0)) if math.isfinite(row[_SUMSQ]) else row[_SUMSQ],
        "mean": mean,
        "std": math.sqrt(max(row[_SUMSQ] / n - mean * mean, 0.0)) if math.isfinite(row[_SUMSQ]) else math.nan,
        "abs_max": row[_ABS_MAX],
        "zero_frac": row[_ZEROS] / n,
        "nonfinite": row[_NONFINITE],
    }
    return {name: values[name] for name in stats}


def abs_mean(row: Sequence[float]) -> float:
    """Mean absolute value of a combined moment row (``nan`` for an empty row); the gradient-flow figure's bars."""
    return row[_ABS_SUM] / row[_COUNT] if row[_COUNT] else math.nan


def histogram(t: torch.Tensor, bins: int) -> torch.Tensor:
    """A float64 row ``[min, max, num, sum, sum_sq, count_0 .. count_{bins-1}]`` over finite values.

    Counted on device from at most :data:`HIST_SAMPLE` evenly strided elements, with
    ``scatter_add`` so that nothing waits for the host.
    """
    x = t.detach().flatten()
    if x.numel() > HIST_SAMPLE:
        x = x[:: math.ceil(x.numel() / HIST_SAMPLE)]
    x = x.double()
    finite = torch.isfinite(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    lo = torch.where(finite, x, torch.full_like(x, math.inf)).amin() if x.numel() else zero
    hi = torch.where(finite, x, torch.full_like(x, -math.inf)).amax() if x.numel() else zero
    safe = torch.where(finite, x, zero)
    width = torch.clamp(hi - lo, min=1e-12)
    index = ((safe - lo) / width * bins).floor().clamp(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=x.dtype, device=x.device).scatter_add_(0, index, finite.to(x.dtype))
    head = torch.stack([lo, hi, finite.sum().to(x.dtype), safe.sum(), (safe * safe).sum()])
    return torch.cat([head, counts])


@dataclass
class Histogram:
    """What TensorBoard's ``add_histogram_raw`` takes."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> Histogram:
        lo, hi, num, total, squares = row[:5]
        counts = list(row[5:])
        width = (hi - lo) / len(counts) if hi > lo else 1e-12
        return cls(lo, hi, num, total, squares, [lo + width * (i + 1) for i in range(len(counts))], counts)


@dataclass
class StatBatch:
    """Rows queued on device during a step, fetched with a single device-to-host copy.

    Rows under the same key (a module called twice, several micro-batches) are combined. Rows
    are taken only while ``open``: a tensor hook that fires after the batch was fetched (a late
    backward) adds nothing to the next one.
    """

    open: bool = False
    moments: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    histograms: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    extra: dict[Key, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.moments) + len(self.histograms) + len(self.extra)

    def start(self) -> None:
        self.clear()
        self.open = True

    def add_moments(self, key: Key, row: torch.Tensor) -> None:
        if self.open:
            self.moments.setdefault(key, []).append(row)

    def add_histogram(self, key: Key, row: torch.Tensor) -> None:
        if self.open:
            self.histograms.setdefault(key, []).append(row)

    def add_scalar(self, key: Key, value: torch.Tensor) -> None:
        if self.open:
            self.extra[key] = value.detach().double().reshape(1)

    def clear(self) -> None:
        self.moments, self.histograms, self.extra = {}, {}, {}
        self.open = False

    def reduce(self, reduce: Callable[[torch.Tensor, str], torch.Tensor], keys: list[Key]) -> None:
        """Pool the moment rows under ``keys`` across processes (before :meth:`fetch`).

        ``reduce(tensor, op)`` is a collective with ``op`` in ``"sum"``, ``"max"`` that every
        process calls with the same ``keys`` (missing rows count as empty).
        """
        if not keys:
            return
        device = next((rows[0].device for rows in self.moments.values()), torch.device("cpu"))
        empty = torch.zeros(MOMENT_WIDTH, dtype=torch.float64, device=device)
        table = torch.stack([combine(self.moments[k]) if k in self.moments else empty for k in keys])
        summed = reduce(table.clone(), "sum")
        summed[:, _ABS_MAX] = reduce(table[:, _ABS_MAX].contiguous(), "max")
        for key, row in zip(keys, summed, strict=True):
            self.moments[key] = [row]

    def fetch(self) -> tuple[dict[Key, list[float]], dict[Key, Histogram], dict[Key, float]]:
        """Combine, move everything to the host in one copy, and empty the batch."""
        parts: list[torch.Tensor] = []
        layout: list[tuple[str, Key, int]] = []
        for key, rows in self.moments.items():
            parts.append(combine(rows))
            layout.append(("m", key, MOMENT_WIDTH))
        for key, rows in self.histograms.items():
            parts.append(_combine_histograms(rows))
            layout.append(("h", key, parts[-1].numel()))
        for key, value in self.extra.items():
            parts.append(value)
            layout.append(("x", key, 1))
        self.clear()  # closes the batch too
        if not parts:
            return {}, {}, {}
        device = parts[0].device
        flat = torch.cat([p.to(device) for p in parts]).tolist()  # the one host transfer
        moment_rows: dict[Key, list[float]] = {}
        hists: dict[Key, Histogram] = {}
        scalars: dict[Key, float] = {}
        offset = 0
        for kind, key, width in layout:
            chunk = flat[offset : offset + width]
            offset += width
            if kind == "m":
                moment_rows[key] = chunk
            elif kind == "h":
                hists[key] = Histogram.from_row(chunk)
            else:
                scalars[key] = chunk[0]
        return moment_rows, hists, scalars


def _combine_histograms(rows: list[torch.Tensor]) -> torch.Tensor:
    # Several calls of one module: keep the first call's buckets (their ranges differ), add the rest's totals.
    if len(rows) == 1:
        return rows[0]
    first = rows[0].clone()
    stacked = torch.stack(rows)
    first[0], first[1] = stacked[:, 0].amin(), stacked[:, 1].amax()
    return first
