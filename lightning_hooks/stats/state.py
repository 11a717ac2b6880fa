"""The combinable state of a tensor's statistics, and the one reduction that makes it (pure torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "CHUNK",
    "RAW_WIDTH",
    "STATS",
    "WIDTH",
    "State",
    "abs_mean",
    "combine",
    "counted",
    "derive",
    "derive_table",
    "flat_pieces",
    "input_sums",
    "nonfinite_count",
    "norm_total",
    "pool",
    "raw_pieces",
    "raw_rows",
    "raw_states",
    "real_view",
    "rms",
    "state",
    "state_row",
]

STATS = ("norm", "mean", "std", "abs_max", "zero_frac", "nonfinite")
"""Every statistic a state gives, in the order :func:`derive_table` gives them."""


class State(NamedTuple):
    """The combinable statistics of one key, on the host: the last field combines by ``max``, the others by ``+``."""

    numel: float = 0.0
    sum: float = 0.0
    sum_sq: float = 0.0
    nonzero: float = 0.0
    nonfinite: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0


WIDTH = len(State._fields)
_SUMMED = WIDTH - 1
RAW_WIDTH = 6
"""The width of a :func:`raw_rows` row."""


def raw_rows(m: torch.Tensor) -> torch.Tensor:
    """Per row of the detached, non-empty matrix ``m``: mean, scatter (the sum of the squared deviations from the
    mean), non-zero and finite counts, sum and largest of magnitudes (what :func:`raw_states` takes), reduced in
    float32 (float64 stays float64). NaN wins the maximum and counts as non-zero."""
    # Half precision is summed in float32 as it is read, with no float32 copy of it: one operator and half the
    # temporaries fewer, and magnitudes are exact in the input's own dtype. Other dtypes (integers) are copied.
    wide = torch.float32 if m.dtype in (torch.float16, torch.bfloat16) else None
    if wide is None and m.dtype not in (torch.float32, torch.float64):
        m = m.float()
    mean = m.mean(1, dtype=wide)
    centred = m - mean.unsqueeze(1)
    # Squares summed, not linalg.vector_norm: on a CPU that norm adds a long row's values into few partial sums (off
    # by 1e-5 at 2**20 values, 1e-3 at 2**23), where sum adds them pairwise.
    scatter = centred.square_().sum(1)
    magnitude = m.abs()
    abs_sum, abs_max = magnitude.sum(1, dtype=wide), magnitude.amax(1)
    nonzero = counted(torch.ne(magnitude, 0, out=centred), 1)  # the temporaries are reused for the flags
    finite = counted(torch.le(magnitude, torch.finfo(m.dtype).max, out=centred), 1)
    return torch.stack([mean, scatter, nonzero, finite, abs_sum, abs_max], 1)


def raw_states(raw: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """The ``(k, WIDTH)`` float64 states of :func:`raw_rows`' rows of ``n`` values each (a number, or one per row)."""
    r = raw.double()
    sizes = r.new_full((r.shape[0], 1), n) if isinstance(n, int) else n.to(r).reshape(-1, 1)
    mean, scatter = r[:, :1], r[:, 1:2]
    total = mean * sizes
    sum_sq = torch.addcmul(scatter, total, mean)  # scatter + n·mean², rebuilt in float64
    return torch.cat([sizes, total, sum_sq, r[:, 2:3], sizes - r[:, 3:4], r[:, 4:]], 1)


def nonfinite_count(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """How many values of the floating-point ``t`` are NaN or Inf (along ``dim``, or in all), on its device.

    A value is finite exactly when its magnitude is at most the dtype's largest (NaN compares false).

    Example::

        >>> int(nonfinite_count(torch.tensor([1.0, -0.0, float("nan"), -float("inf"), 3e38])))
        2
    """
    magnitude = t.detach().abs()
    size = magnitude.numel() if dim is None else magnitude.shape[dim]
    return size - counted(torch.le(magnitude, torch.finfo(magnitude.dtype).max, out=magnitude), dim)


def counted(flags: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The sum of 0/1 ``flags``: in their float dtype while that counts exactly (up to 2**24), in float64 beyond."""
    size = flags.numel() if dim is None else flags.shape[dim]
    wide = size > 1 << 24 or flags.dtype in (torch.float16, torch.bfloat16)
    return flags.sum(dim, dtype=torch.float64 if wide else None)


CHUNK = 1 << 23
"""The most values of one tensor reduced at once: a larger one (a language model's logits) is reduced in pieces; and
about the most values of several tensors laid end to end by :func:`flat_pieces`."""


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a complex ``t`` as its real and imaginary parts (a view of a last dimension of two): the statistics,
    clamp and checks take a complex value for two real ones, as torch's optimizers do."""
    return torch.view_as_real(t) if t.is_complex() else t


def flat_pieces(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The values of the dense ``tensors`` (of one device) end to end, in flat pieces of up to :data:`CHUNK` values (a
    larger tensor is a piece of its own, as a view): an operator or two per piece rather than per tensor.

    Example::

        >>> [p.tolist() for p in flat_pieces([torch.ones(2), torch.zeros(1, 2), torch.full((CHUNK,), 2.0)])][0]
        [1.0, 1.0, 0.0, 0.0]
    """
    piece: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if piece and size + t.numel() > CHUNK:
            yield _flattened(piece)
            piece, size = [], 0
        piece.append(t)
        size += t.numel()
    if piece:
        yield _flattened(piece)


def _flattened(tensors: list[torch.Tensor]) -> torch.Tensor:
    # torch's own flattening (DDP's buckets): one copy in C++, the dtypes promoted as torch.cat does
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch._utils._flatten_dense_tensors(tensors)


def state_row(t: torch.Tensor) -> torch.Tensor:
    """The float64 state of ``t`` as a ``WIDTH`` vector on its device (what a compiled graph outputs).

    Example::

        >>> t = torch.randn(3 * CHUNK // 2, generator=torch.Generator().manual_seed(0))
        >>> row = state_row(t)
        >>> int(row[0]) == t.numel(), bool(torch.isclose(row[2], (t.double() ** 2).sum(), rtol=1e-3))
        (True, True)
    """
    if not t.numel():
        return torch.zeros(WIDTH, dtype=torch.float64, device=t.device)
    raw, sizes = raw_pieces(t.detach())
    if len(sizes) == 1:
        return raw_states(raw, sizes[0])[0]
    states = raw_states(raw, torch.tensor(sizes, dtype=torch.float64, device=raw.device))
    return torch.cat([states[:, :_SUMMED].sum(0), states[:, _SUMMED:].amax(0)])


def raw_pieces(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The :func:`raw_rows` of the detached, non-empty ``t``'s values in pieces of at most :data:`CHUNK` (so that a
    half-precision tensor's float32 copy stays near 32 MiB however large it is), and the pieces' sizes."""
    n = t.numel()
    if n <= CHUNK:
        return raw_rows(t.reshape(1, -1)), [n]
    pieces = t.reshape(-1).split(CHUNK)
    return torch.cat([raw_rows(piece.unsqueeze(0)) for piece in pieces]), [piece.numel() for piece in pieces]


def state(t: torch.Tensor) -> State:
    """The state of one tensor, on the host (for one-off use and tests).

    Example::

        >>> derive(state(torch.tensor([3.0, 0.0, -4.0])), ["mean", "abs_max", "nonfinite"])
        {'mean': -0.3333333432674408, 'abs_max': 4.0, 'nonfinite': 0.0}
    """
    return State._make(state_row(t).tolist())


def pool(table: torch.Tensor, index: torch.Tensor, keys: int) -> torch.Tensor:
    """Combine the rows of ``table`` that share an ``index`` into ``keys`` states: ``+``, and ``max`` (NaN wins)."""
    out = table.new_zeros(keys, WIDTH)
    out[:, :_SUMMED].index_add_(0, index, table[:, :_SUMMED])
    peaks = table[:, _SUMMED:]
    out[:, _SUMMED:].scatter_reduce_(0, index.unsqueeze(1), peaks, "amax")
    # A NaN peak must win whatever scatter's amax does with NaN on a given device.
    nan_peaks = table.new_zeros(keys, 1).index_add_(0, index, peaks.isnan().to(table.dtype))
    out[:, _SUMMED:] = torch.where(nan_peaks > 0, math.nan, out[:, _SUMMED:])
    return out


def derive_table(states: torch.Tensor, stats: Sequence[str] = STATS) -> torch.Tensor:
    """The named statistics of each row of a ``(k, WIDTH)`` float64 state table, as a ``(k, len(stats))`` matrix
    (NaN or 0 for an empty state, which callers leave out)."""
    n, total, squares, nonzero, nonfinite, _, abs_max = states.unbind(1)
    mean = total / n
    finite = torch.isfinite(squares)
    columns = {
        "norm": torch.where(finite, squares.clamp_min(0.0).sqrt(), squares),
        "mean": mean,
        "std": torch.where(finite, (squares / n - mean * mean).clamp_min(0.0).sqrt(), math.nan),
        "abs_max": abs_max,
        "zero_frac": 1.0 - nonzero / n,
        "nonfinite": nonfinite,
    }
    return torch.stack([columns[name] for name in stats], dim=1)


def derive(state: State, stats: Sequence[str] = STATS) -> dict[str, float]:
    """The named statistics of one host state; nothing for an empty one."""
    if not state.numel:
        return {}
    values = derive_table(torch.tensor([state], dtype=torch.float64), stats)[0].tolist()
    return dict(zip(stats, values, strict=True))


def combine(rows: Iterable[State]) -> State:
    """One state for several on the host (a layer's weight and bias): ``+``, and ``max`` (NaN wins)."""
    rows = list(rows)
    if not rows:
        return State()
    if len(rows) == 1 and rows[0].numel:  # most layers have one output tensor
        return rows[0]
    summed = [math.fsum(column) for column in zip(*(r[:_SUMMED] for r in rows), strict=True)]
    peaks = [r.abs_max for r in rows if r.numel]
    peak = math.nan if any(math.isnan(p) for p in peaks) else max(peaks, default=0.0)
    return State._make([*summed, peak])


def abs_mean(state: State) -> float:
    """Mean absolute value (``nan`` for an empty state)."""
    return state.abs_sum / state.numel if state.numel else math.nan


def rms(state: State) -> float:
    """Root mean square (``nan`` for an empty state)."""
    return math.sqrt(max(state.sum_sq, 0.0) / state.numel) if state.numel else math.nan


def norm_total(states: Iterable[State]) -> float:
    """The 2-norm of all the tensors behind ``states`` together (``grad_norm_total``)."""
    return math.sqrt(math.fsum(max(s.sum_sq, 0.0) for s in states))


def input_sums(t: torch.Tensor) -> torch.Tensor:
    """``[Σx², count, fill, 1]`` over a batch tensor's finite non-zero values (a sparse tensor's stored ones), added up
    over micro-batches and processes: their RMS is ``sqrt(Σx² / count)``, and ``fill == 1`` (one per tensor added)
    marks an additive mask, whose non-zero values are all one negative number (``-inf``, ``-1e9``, the dtype's
    lowest).

    Example::

        >>> input_sums(torch.tensor([0.0, 3.0, -4.0])).tolist()
        [25.0, 2.0, 0.0, 1.0]
        >>> input_sums(torch.tensor([0.0, 0.0, float("-inf")])).tolist()
        [0.0, 0.0, 1.0, 1.0]
        >>> input_sums(torch.tensor([[0.0, 3.0], [-4.0, 0.0]]).to_sparse()).tolist()  # its stored values
        [25.0, 2.0, 0.0, 1.0]
    """
    x = t.detach()
    if x.layout == torch.sparse_coo:
        x = x.coalesce().values()
    elif x.layout != torch.strided:  # compressed sparse rows or columns, or blocks of them
        x = x.values()
    x = x.float()
    lowest = x.amin()
    fill = (x.eq(lowest).sum() == x.count_nonzero()) & (lowest < 0)  # every non-zero value is the lowest, negative
    finite = x.nan_to_num(0.0, 0.0, 0.0)
    return torch.stack([finite.square().sum(), finite.count_nonzero(), fill, torch.ones_like(lowest)]).float()
