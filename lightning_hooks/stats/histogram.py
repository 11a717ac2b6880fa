"""Histograms counted on device, read on the host as TensorBoard's ``HistogramProto`` takes them (pure torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["HIST_SAMPLE", "Histogram", "histogram_rows", "sample"]

HIST_SAMPLE = 1 << 16
"""A histogram counts at most this many elements of each call's tensor (an even stride through it)."""


def sample(t: torch.Tensor) -> torch.Tensor:
    """At most :data:`HIST_SAMPLE` evenly strided elements of ``t``, copied (a later in-place op cannot change them)."""
    x = t.detach().flatten()
    if x.numel() > HIST_SAMPLE:
        x = x[:: math.ceil(x.numel() / HIST_SAMPLE)]
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32, copy=True)


def histogram_rows(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Per row of the matrix ``x``, ``[min, max, num, sum, sum_sq, count_0 .. count_{bins-1}]`` in float64.

    ``bins`` equal buckets from the smallest to the largest finite value of the row, as ``torch.histc``
    lays them; NaN and Inf are left out.

    Example::

        >>> histogram_rows(torch.tensor([[0.0, 1.0, 1.0, float("nan")]]), 2).tolist()
        [[0.0, 1.0, 3.0, 2.0, 2.0, 1.0, 2.0]]
    """
    k, n = x.shape
    f64 = torch.float64
    if n == 0:
        return torch.zeros(k, 5 + bins, dtype=f64, device=x.device)
    lo = torch.nan_to_num(x, nan=math.inf, posinf=math.inf, neginf=math.inf).amin(1, keepdim=True)  # finite ones
    hi = torch.nan_to_num(x, nan=-math.inf, posinf=-math.inf, neginf=-math.inf).amax(1, keepdim=True)
    safe = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    # Bucket 0 of each row takes its NaN and Inf (counted with the others, then left out), 1 to ``bins`` its values.
    position = (x - lo).div_(torch.clamp(hi - lo, min=1e-12)).mul_(bins)
    position.nan_to_num_(nan=-1.0, posinf=-1.0, neginf=-1.0).floor_().clamp_(max=bins - 1)
    # Row r's buckets start at r * (bins + 1): exact in float32 up to 2**24 buckets (258,000 rows of 64 bins).
    position += torch.arange(1, k * (bins + 1), bins + 1, dtype=position.dtype, device=x.device).unsqueeze(1)
    counts = torch.zeros(k * (bins + 1), dtype=f64, device=x.device)
    counts.scatter_add_(0, position.long().view(-1), torch.ones(1, dtype=f64, device=x.device).expand(k * n))
    counts = counts.view(k, bins + 1)
    squares = safe.square().sum(1, keepdim=True)
    columns = [lo, hi, n - counts[:, :1], safe.sum(1, keepdim=True), squares]
    return torch.cat([*(c.to(f64) for c in columns), counts[:, 1:]], 1)


@dataclass(frozen=True)
class Histogram:
    """One key's histogram on the host, as TensorBoard's ``add_histogram_raw`` takes it.

    Example::

        >>> hist = Histogram.of([0.0, 2.0, 3.0, 2.5, 4.25, 2.0, 1.0])
        >>> hist.num, hist.bucket_limits, hist.bucket_counts
        (3.0, [1.0, 2.0], [2.0, 1.0])
    """

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    """The right edge of each bucket: equal buckets from ``min`` to ``max``."""
    bucket_counts: list[float]

    @classmethod
    def of(cls, row: Sequence[float]) -> Histogram:
        """The histogram of a :func:`histogram_rows` row."""
        lo, hi, num, total, squares, *counts = (float(v) for v in row)
        width = (hi - lo) / len(counts) if hi > lo else 1e-12
        limits = [lo + width * (i + 1) for i in range(len(counts))]
        return cls(lo, hi, num, total, squares, limits, counts)
