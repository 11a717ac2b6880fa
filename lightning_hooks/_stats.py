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
from typing import NamedTuple

import torch

STATS = ("norm", "mean", "std", "abs_max", "zero_frac", "nonfinite")
"""Every statistic a row can give."""

Key = tuple[str, str]
"""``(group, name)``: what a row is of, e.g. ``("param", "fc1.weight")``."""

_COUNT, _SUM, _SUMSQ, _ABS_MAX, _ZEROS, _NONFINITE, _ABS_SUM = range(7)
MOMENT_WIDTH = 7
RAW_WIDTH = 6
HIST_SAMPLE = 1 << 16
"""Histograms count at most this many elements of a tensor (an even stride through it)."""


class Moments(NamedTuple):
    """One tensor's reduction as computed on its device, in the fewest and cheapest kernels.

    ``raw`` is a float64 ``[mean, spread, abs_max, abs_sum, nonzero, nonfinite]`` on the tensor's
    device, where ``spread`` is the L2 norm of ``x - mean`` (``None`` for an empty tensor); the
    element count ``numel`` is known on the host. :func:`row` turns the fetched values into the
    combinable moment row ``[count, sum, sum_sq, abs_max, zeros, nonfinite, abs_sum]`` (on the
    host, in float64, after the step's one transfer).
    """

    numel: int
    raw: torch.Tensor | None

    def row(self) -> list[float]:
        """The moment row on the host (one transfer; for tests and one-off use)."""
        return row(self.numel, None if self.raw is None else self.raw.tolist())


def moments(t: torch.Tensor) -> Moments:
    """Reduce ``t`` on its device: what a logging step pays per tensor.

    The spread is taken around the mean (two passes), so the variance keeps its precision when
    it is tiny next to the squared mean; the sum of squares is rebuilt from both in float64 on
    the host, so that rows of different tensors add up exactly. The kernels are chosen for their
    cost on large tensors: ``count_nonzero`` counts zeros, and non-finite values (``|x| * 0`` is
    NaN exactly for them) far faster than a boolean mask summed; ``var_mean`` and vector norms
    of orders 1 and inf are several times slower than the plain reductions used here.
    """
    x = t.detach()
    n = x.numel()
    if n == 0:
        return Moments(0, None)
    xf = x.float()  # itself when already float32
    mean = xf.mean()
    magnitude = xf.abs()
    raw = torch.stack(  # the float64 mean makes the whole row float64: counts stay exact
        [
            mean.double(),
            torch.linalg.vector_norm(xf - mean),
            magnitude.amax(),
            magnitude.sum(),
            torch.count_nonzero(xf),
            torch.count_nonzero(magnitude * 0),
        ]
    )
    return Moments(n, raw)


def row(count: int, raw: Sequence[float] | None) -> list[float]:
    """The moment row of a tensor of ``count`` elements from its fetched ``raw`` values."""
    if raw is None:
        return [0.0] * MOMENT_WIDTH
    mean, spread, abs_max, abs_sum, nonzero, nonfinite = raw
    return [count, mean * count, spread * spread + count * mean * mean, abs_max, count - nonzero, nonfinite, abs_sum]


def combine(rows: Sequence[Sequence[float]]) -> list[float]:
    """One moment row for several (on the host): sums add, the abs-max is the largest (NaN wins)."""
    if len(rows) == 1:
        return list(rows[0])
    out = [math.fsum(column) for column in zip(*rows, strict=True)]
    peaks = [r[_ABS_MAX] for r in rows if r[_COUNT]]
    out[_ABS_MAX] = math.nan if any(math.isnan(p) for p in peaks) else max(peaks, default=0.0)
    return out


def device_row(m: Moments, device: torch.device) -> torch.Tensor:
    """The moment row of ``m`` as a float64 tensor on ``device`` (for collectives across processes)."""
    if m.raw is None:
        return torch.zeros(MOMENT_WIDTH, dtype=torch.float64, device=device)
    mean, spread, abs_max, abs_sum, nonzero, nonfinite = m.raw.unbind()
    n = float(m.numel)
    sum_sq = spread * spread + n * mean * mean
    return torch.stack([mean.new_tensor(n), mean * n, sum_sq, abs_max, n - nonzero, nonfinite, abs_sum])


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
    moments: dict[Key, list[Moments]] = field(default_factory=dict)
    pooled: dict[Key, torch.Tensor] = field(default_factory=dict)
    histograms: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    extra: dict[Key, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.moments) + len(self.pooled) + len(self.histograms) + len(self.extra)

    def start(self) -> None:
        self.clear()
        self.open = True

    def add_moments(self, key: Key, m: Moments) -> None:
        if self.open:
            self.moments.setdefault(key, []).append(m)

    def add_histogram(self, key: Key, row: torch.Tensor) -> None:
        if self.open:
            self.histograms.setdefault(key, []).append(row)

    def add_scalar(self, key: Key, value: torch.Tensor) -> None:
        if self.open:
            self.extra[key] = value.detach().double().reshape(1)

    def clear(self) -> None:
        self.moments, self.pooled, self.histograms, self.extra = {}, {}, {}, {}
        self.open = False

    def reduce(self, reduce: Callable[[torch.Tensor, str], torch.Tensor], keys: list[Key]) -> None:
        """Pool the moment rows under ``keys`` across processes (before :meth:`fetch`).

        ``reduce(tensor, op)`` is a collective with ``op`` in ``"sum"``, ``"max"`` that every
        process calls with the same ``keys`` (missing rows count as empty).
        """
        if not keys:
            return
        device = next((m.raw.device for ms in self.moments.values() for m in ms if m.raw is not None), None)
        device = device or torch.device("cpu")
        empty = torch.zeros(1, MOMENT_WIDTH, dtype=torch.float64, device=device)
        # One (calls x MOMENT_WIDTH) block of device rows per key; a key this process never saw is one empty row.
        rows = [
            torch.stack([device_row(m, device) for m in self.moments[k]]) if k in self.moments else empty for k in keys
        ]
        table = torch.stack([r.sum(dim=0) for r in rows])
        peaks = torch.stack([r[:, _ABS_MAX].amax() for r in rows])
        summed = reduce(table, "sum")
        summed[:, _ABS_MAX] = reduce(peaks, "max")
        for key, pooled in zip(keys, summed, strict=True):
            self.moments.pop(key, None)
            self.pooled[key] = pooled

    def fetch(self) -> tuple[dict[Key, list[float]], dict[Key, Histogram], dict[Key, float]]:
        """Combine, move everything to the host in one copy, and empty the batch."""
        parts: list[torch.Tensor] = []
        layout: list[tuple[str, Key, list[int]]] = []  # kind, key, counts of the raw moments
        for key, ms in self.moments.items():
            layout.append(("m", key, [m.numel for m in ms]))
            parts.extend(m.raw for m in ms if m.raw is not None)
        for key, pooled in self.pooled.items():
            layout.append(("p", key, []))
            parts.append(pooled)
        for key, rows in self.histograms.items():
            parts.append(_combine_histograms(rows))
            layout.append(("h", key, [parts[-1].numel()]))
        for key, value in self.extra.items():
            parts.append(value)
            layout.append(("x", key, []))
        self.clear()  # closes the batch too
        if not parts:
            return {}, {}, {}
        device = parts[0].device
        flat = torch.cat([p.to(device) for p in parts]).tolist()  # the one host transfer
        moment_rows: dict[Key, list[float]] = {}
        hists: dict[Key, Histogram] = {}
        scalars: dict[Key, float] = {}
        offset = 0

        def take(width: int) -> list[float]:
            nonlocal offset
            offset += width
            return flat[offset - width : offset]

        for kind, key, sizes in layout:
            if kind == "m":
                moment_rows[key] = combine([row(n, take(RAW_WIDTH) if n else None) for n in sizes])
            elif kind == "p":
                moment_rows[key] = take(MOMENT_WIDTH)
            elif kind == "h":
                hists[key] = Histogram.from_row(take(sizes[0]))
            else:
                scalars[key] = take(1)[0]
        return moment_rows, hists, scalars


def _combine_histograms(rows: list[torch.Tensor]) -> torch.Tensor:
    # Several calls of one module: keep the first call's buckets (their ranges differ), add the rest's totals.
    if len(rows) == 1:
        return rows[0]
    first = rows[0].clone()
    stacked = torch.stack(rows)
    first[0], first[1] = stacked[:, 0].amin(), stacked[:, 1].amax()
    return first
