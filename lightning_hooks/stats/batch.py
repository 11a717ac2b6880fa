"""Per-tensor statistics: one state per key, combined on device, brought to the host in one transfer.

Every statistic a user sees (norm, mean, std, ...) is derived from one *state* per key: a float64
vector whose fields combine by ``+`` (count, sum, sum of squares, non-zeros, non-finite values,
sum of magnitudes) or by ``max`` (largest magnitude), the idea of torchmetrics'
``add_state(dist_reduce_fx=...)``. Several calls of a module, the micro-batches of a step, the
processes of a DDP run (and the shards of a parameter) all pool through :func:`pool` and
:meth:`StatBatch.fetch` with exactly those two reductions.

What a call pays (:meth:`StatBatch.add`) is a copy of a small tensor into a row of a buffer for its
device and shape, full buffers being reduced row by row (:func:`observe_rows`), or for a large
tensor :func:`observe`: a handful of cheap reductions on its device. Tensors that are all at hand
at once (every parameter's gradient) go through :func:`observe_many`: stacked by shape, or in one
buffer per device and dtype with segment reductions over it. Either way the number of reduction
operators does not grow with the number of tensors.
Observations are turned into states, pooled per key and, where asked, across processes at the end
of the step, in a few vectorised kernels whatever the number of keys; the pooled states, the
histograms and any extra scalars then cross to the host in one copy.

Histograms keep a bounded, evenly strided sample of each call's finite values on device until the
step is fetched, so that the buckets of a key are laid over the range of all of its calls and
every sampled value is counted in the bucket that contains it.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
import struct
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import torch

from lightning_hooks.core.select import output_label

if TYPE_CHECKING:  # the host arrays of a fetch are numpy's (``Tensor.numpy()``); nothing here imports numpy
    import numpy as np
    from numpy.typing import NDArray

    Row: TypeAlias = Sequence[float] | NDArray[np.float64]

STATS = ("norm", "mean", "std", "abs_max", "zero_frac", "nonfinite")
"""Every statistic a state can give."""

Key = tuple[str, str]
"""``(group, name)``: what a state is of, e.g. ``("param", "fc1.weight")``."""


class OutputKeys:
    """The key of each output tensor of each module, ``(group, <layer>[.out.<path>])``, made once and then looked up."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._keys: dict[tuple[str, str], Key] = {}

    def key(self, module: str, path: str) -> Key:
        if torch.compiler.is_compiling():  # a constant of the graph; a lookup would guard on the cache's contents
            return (self.group, output_label(module, path))
        return self.eager(module, path)

    def eager(self, module: str, path: str) -> Key:
        """:meth:`key` where no compiler traces the caller (attaching a hook): no compile check."""
        found = self._keys.get((module, path))
        if found is None:
            found = self._keys[module, path] = (self.group, output_label(module, path))
        return found


HIST_SAMPLE = 1 << 16
"""Histograms count at most this many elements of each call's tensor (an even stride through it)."""


class State(NamedTuple):
    """The combinable statistics of one key, on the host. The last field combines by ``max``, the others by ``+``."""

    numel: float = 0.0
    sum: float = 0.0
    sum_sq: float = 0.0
    nonzero: float = 0.0
    nonfinite: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0


WIDTH = len(State._fields)
_SUMMED = WIDTH - 1
"""Fields ``[:_SUMMED]`` of a state combine by ``+``, the rest by ``max``."""


class Observation(NamedTuple):
    """One tensor reduced on its device, before it becomes a state (see :func:`observe`).

    ``raw`` is a float64 ``[mean, spread, abs_max, abs_sum, nonzero, nonfinite]`` on the tensor's
    device, ``spread`` being the L2 norm of ``x - mean``; ``None`` for an empty tensor. ``numel``
    is known on the host.
    """

    numel: int
    raw: torch.Tensor | None


def observe(t: torch.Tensor) -> Observation:
    """Reduce ``t`` on its device: what a call pays on a logging step.

    The spread is taken around the mean (two passes), so the variance keeps its precision when it
    is tiny next to the squared mean; the sum of squares is rebuilt from both in float64 when the
    observation becomes a state. The kernels are the cheapest measured on large tensors:
    ``count_nonzero`` counts non-zeros, and non-finite values (``|x| * 0`` is NaN exactly for
    them), far faster than a boolean mask summed; ``var_mean`` and vector norms of orders 1 and inf
    are several times slower than the plain reductions used here.
    """
    x = t.detach()
    n = x.numel()
    if n == 0:
        return Observation(0, None)
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
    return Observation(n, raw)


ROW_MAX = 1 << 15
""":meth:`StatBatch.add` copies tensors of at most this many elements and reduces them later, many at once.

Such a tensor costs :func:`observe` about 35 µs on CPU (3 µs per operator, and each of its few
thousand elements in cache), most of it launch cost: a float32 copy in the hook into the next row
of a matrix for its shape, whose rows are reduced together (:func:`observe_rows`), costs about a
third of that. A larger tensor's own work outweighs its launches: it is reduced in the hook by
:func:`observe`, as before, with no copy.
"""

ROW_CHUNK = 1 << 17
"""A bucket has rows for this many elements (512 KB of float32) and is reduced when they are all written.

Small enough for the matrix and its temporary to stay in a core's cache: on the development
VM, the rows of 342 tensors of 8,192 elements took 3.6 ms in matrices of 16 rows, 6.2 ms in
matrices of 128 and 8.5 ms in one (each pass then streams from memory), against 12.8 ms for
:func:`observe` on each. It also bounds what a bucket holds: at most this many elements.
"""

PENDING_MAX = 1 << 22
"""Elements the buffers of all waiting buckets may hold together (16 MB of float32, 32 buckets) before every bucket
is reduced: a model of many distinct shapes does not keep a buffer for each."""


def observe_rows(m: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``(k, 6)`` float64 rows in :class:`Observation`'s ``raw`` layout, one per row of the float32 matrix ``m``.

    What :func:`observe` gives for each row, in a dozen operators for all of them; ``m`` is
    overwritten (it is a copy made for this). Counts are float32 sums of ones, exact for rows of
    up to 2**24 elements. Cheaper kernels than those of :func:`observe` on a row-wise matrix:
    ``count_nonzero(dim=1)`` measured 4.6 ms on 2.8 M elements, a comparison written into a float
    matrix and summed 0.8 ms. On CPU, rows whose sum of magnitudes is finite hold no NaN or Inf,
    which saves the three passes that count them. ``scratch``, a float32 matrix of ``m``'s shape,
    takes the magnitudes if given.
    """
    mean = m.sum(1).div_(m.shape[1])  # ``mean(1)`` divides in a slower kernel
    magnitude = m.abs() if scratch is None else torch.abs(m, out=scratch)
    abs_max = magnitude.amax(1)  # NaN wins
    abs_sum = magnitude.sum(1)
    spread = torch.linalg.vector_norm(m.sub_(mean.unsqueeze(1)), dim=1)
    nonzero = torch.ne(magnitude, 0, out=m).sum(1)  # NaN counts as non-zero, as in count_nonzero
    # A finite sum of magnitudes: no NaN or Inf to count.
    nonfinite = torch.zeros_like(abs_sum) if surely_finite(abs_sum) else _count_nonfinite(magnitude, m)
    return torch.stack([mean, spread, abs_max, abs_sum, nonzero, nonfinite], dim=1).double()


def surely_finite(sums: torch.Tensor) -> bool:
    """Whether ``sums`` (one per row: of magnitudes, a norm) are all finite, so that their rows hold no NaN or Inf.

    Asked only on CPU, where reading a value costs no transfer (elsewhere ``False``: count them on
    device). A sum of finite values that overflowed answers ``False`` too; the caller then counts.
    """
    # One sum read as a float: ``isfinite().all()`` is five operators on CPU (a third of a bucket's small ones).
    return sums.device.type == "cpu" and math.isfinite(float(sums.sum()))


def _count_nonfinite(magnitude: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per row, the NaN and Inf values behind ``magnitude`` (``|x| * 0`` is NaN exactly for them); both overwritten."""
    return torch.ne(magnitude.mul_(0), 0, out=out).sum(1)


def observe_norms(m: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`observe_rows` for a caller that needs only each row's mean, sum of squares, largest magnitude and
    count of NaN and Inf: what the ``norm``, ``mean``, ``abs_max`` and ``nonfinite`` statistics derive from.

    Four read passes over ``m`` (sum, L2 norm, max, min) where :func:`observe_rows` makes eight
    and writes three. The sum of magnitudes and the non-zero count are not computed: NaN, and so
    is what derives from them (``zero_frac``); the spread is rebuilt from the float32 sum of
    squares, so ``std`` is only as precise as that when the mean is large against it. ``m`` is
    overwritten only when a row holds NaN or Inf (or its squares overflow), to count them.
    """
    total, norm = m.sum(1), torch.linalg.vector_norm(m, dim=1)
    high, low = m.amax(1), m.amin(1)  # NaN wins
    if surely_finite(norm):
        nonfinite = torch.zeros_like(total)
    else:
        nonfinite = _count_nonfinite(m.abs() if scratch is None else torch.abs(m, out=scratch), m)
    total, norm, high, low, nonfinite = torch.stack([total, norm, high, low, nonfinite], dim=1).double().unbind(1)
    mean = total / m.shape[1]
    spread = torch.addcmul(norm * norm, mean, total, value=-1).clamp_(min=0.0).sqrt_()  # NaN stays NaN
    unknown = torch.full_like(mean, math.nan)
    return torch.stack([mean, spread, torch.maximum(high, -low), unknown, unknown, nonfinite], dim=1)


FUSED_MAX = 1024
""":func:`observe_many` fuses tensors of at most this many elements and reduces larger ones one by one.

Measured on CPU: the fused path costs about 30 ns per element (float64 passes, segment
reductions), a reduction per tensor about 30 µs plus a few ns per element; fusing wins below
about 1,000 elements. Above, a tensor's own work outweighs its kernels' launch cost anyway.
"""

FUSED_CHUNK = 1 << 22
""":func:`observe_many` reduces at most this many elements at once (bounds its temporaries: 16 bytes each)."""


def observe_many(tensors: Sequence[torch.Tensor]) -> list[Observation]:
    """What :func:`observe` gives for each of ``tensors``, in a number of operators that does not grow with their count.

    Tensors of one device, dtype and shape (a transformer's layers repeat theirs) of at most
    :data:`ROW_MAX` elements are stacked, :data:`ROW_CHUNK` elements at a time, into matrices
    reduced row by row (:func:`observe_rows`: one float32 pass per statistic, as :func:`observe`).
    Of the others, those of at most :data:`FUSED_MAX` elements are grouped by device and dtype;
    each group, in chunks of at most :data:`FUSED_CHUNK` elements, is flattened into one float64
    buffer by one operator and reduced per tensor with segment reductions (``torch.segment_reduce``
    over the tensors' lengths: about 30 ns per element, against 1 to 2 for rows). Larger tensors
    are reduced one by one with :func:`observe`, whose launch cost their own work outweighs. So the
    count of operators grows with the number of distinct shapes and of large tensors only.
    (torch's ``_foreach_norm`` and ``_foreach_powsum`` are single kernels on CUDA but loop over the
    tensors on CPU, where they measured no faster than one reduction per tensor.)
    """
    found = [Observation(0, None)] * len(tensors)
    groups, singles = _observed_groups(tensors)
    for indices, raw in groups:
        for i, row in zip(indices, raw.unbind(0), strict=True):
            found[i] = Observation(tensors[i].numel(), row)
    for i in singles:
        found[i] = observe(tensors[i])
    return found


class Chunks(NamedTuple):
    """How :func:`observe_many` reduces a list of tensors, by index: see :func:`chunks`."""

    stacks: list[list[int]]
    """Tensors of one device, dtype and shape, to be stacked into a matrix (see :func:`shape_chunks`)."""
    fused: list[list[int]]
    """Other tensors of 1 to :data:`FUSED_MAX` elements, of one device and dtype, to be flattened into one buffer."""
    singles: list[int]
    """The rest but empty tensors: larger ones, reduced one by one."""


def chunks(tensors: Sequence[torch.Tensor]) -> Chunks:
    """The :class:`Chunks` of ``tensors``: they depend on each one's device, dtype and shape only, so a
    parameter's serve for its gradient (which torch keeps of the same device, dtype and shape)."""
    stacks, rest = shape_chunks(tensors)
    fused = [[rest[j] for j in chunk] for chunk in fused_chunks([tensors[i] for i in rest])]
    return Chunks(stacks, fused, [i for i in rest if tensors[i].numel() > FUSED_MAX])


def _observed_groups(
    tensors: Sequence[torch.Tensor], layout: Chunks | None = None
) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
    """:func:`observe_many`'s matrices, and the tensors to observe one by one (``layout``: their
    :func:`chunks`, if known).

    ``(groups, singles)``: each group is ``(indices, raw)``, ``raw[j]`` the row of ``tensors[indices[j]]``;
    ``singles`` are the indices of the tensors of more than :data:`FUSED_MAX` elements that share no shape.
    Empty tensors are in neither.
    """
    stacks, fused, singles = chunks(tensors) if layout is None else layout
    groups: list[tuple[list[int], torch.Tensor]] = []
    with torch.no_grad():
        for part in stacks:
            n = tensors[part[0]].numel()
            # a new matrix (float32 already, or converted): observe_rows may overwrite it
            stacked = torch.stack([tensors[i] for i in part]).view(len(part), n)
            groups.append((part, observe_rows(stacked.to(torch.float32))))
        for part in fused:
            groups.append((part, _fused_raw([tensors[i] for i in part])))
    return groups, singles


def shape_chunks(tensors: Sequence[torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    """``(stacks, rest)``: the indices of ``tensors`` that share a device, dtype and shape with another, of 1 to
    :data:`ROW_MAX` elements, in chunks of at most :data:`ROW_CHUNK` elements (each to be stacked into a matrix);
    and the indices of the others, in order."""
    shapes: dict[tuple[torch.device, torch.dtype, torch.Size], list[int]] = {}
    for i, t in enumerate(tensors):
        if 0 < t.numel() <= ROW_MAX:
            shapes.setdefault((t.device, t.dtype, t.shape), []).append(i)
    stacks: list[list[int]] = []
    for indices in shapes.values():
        if len(indices) > 1:
            per = max(1, ROW_CHUNK // tensors[indices[0]].numel())
            stacks += [indices[start : start + per] for start in range(0, len(indices), per)]
    stacked = {i for part in stacks for i in part}
    return stacks, [i for i in range(len(tensors)) if i not in stacked]


def fused_chunks(tensors: Sequence[torch.Tensor], largest: int = FUSED_MAX) -> Iterator[list[int]]:
    """Indices of the ``tensors`` of 1 to ``largest`` elements by device and dtype, in chunks of at most
    :data:`FUSED_CHUNK` elements."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if 0 < t.numel() <= largest:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for indices in groups.values():
        for part in size_chunks([tensors[i].numel() for i in indices], FUSED_CHUNK):
            yield indices[part]


def size_chunks(sizes: Sequence[int], limit: int) -> Iterator[slice]:
    """Consecutive runs of ``sizes`` that add up to at most ``limit`` (an item larger than that alone), in order.

    Example::

        >>> [(s.start, s.stop) for s in size_chunks([3, 2, 4, 9, 1], limit=5)]
        [(0, 2), (2, 3), (3, 4), (4, 5)]
    """
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            yield slice(start, i)
            start, total = i, 0
        total += n
    if sizes:
        yield slice(start, len(sizes))


_ARRAY_TYPES = {torch.int64: "q", torch.float64: "d"}


def host_vector(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a list of ints (``int64``) or numbers (``float64``).

    Made through an ``array.array``, which converts the list in C: ``torch.tensor`` looks at each
    element in Python, about 1,500 instructions an element against about 30 (callgrind, lists of
    827; three of them made 3.3 M of the 6.3 M of a logging step's pooling on the 24-layer encoder).
    """
    if not values:
        return torch.zeros(0, dtype=dtype, device=device)
    vector = torch.frombuffer(array.array(_ARRAY_TYPES[dtype], values), dtype=dtype)  # keeps the array alive
    return vector if device.type == "cpu" else vector.to(device)


def flatten(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, lengths)``: tensors of one device and dtype end to end in one buffer (one operator), and their sizes.

    The buffer is a view of the tensor when there is only one: never write into it.
    """
    values = torch._C._nn.flatten_dense_tensors(tensors)
    return values, host_vector([t.numel() for t in tensors], torch.int64, values.device)


def segment_sum(values: torch.Tensor, lengths: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """One ``reduce`` per consecutive segment of ``values`` of the given ``lengths`` (one operator for them all)."""
    return torch.segment_reduce(values, reduce, lengths=lengths)


def _fused_raw(xs: list[torch.Tensor]) -> torch.Tensor:
    """``(len(xs), 6)`` rows in :class:`Observation`'s ``raw`` layout for non-empty tensors of one device and dtype."""
    f64 = torch.float64
    values, lengths = flatten(xs)
    flat = values.to(f64)
    count = lengths.to(f64)
    total = segment_sum(flat, lengths)
    nonzero = segment_sum((flat != 0).to(f64), lengths)  # NaN counts as non-zero, as in count_nonzero
    magnitude = flat.abs()
    abs_sum = segment_sum(magnitude, lengths)
    abs_max = segment_sum(magnitude, lengths, "max")  # NaN wins
    nonfinite = count - segment_sum(torch.isfinite(magnitude).to(f64), lengths)
    sum_sq = segment_sum(magnitude.mul_(magnitude), lengths)
    mean = total / count
    spread = torch.sqrt(torch.clamp(sum_sq - total * mean, min=0.0))  # NaN and inf stay what they are
    return torch.stack([mean, spread, abs_max, abs_sum, nonzero, nonfinite], dim=1)


def state(t: torch.Tensor) -> State:
    """The state of one tensor, on the host (one transfer; for one-off use and tests).

    Example::

        >>> derive(state(torch.tensor([3.0, 0.0, -4.0])), ["mean", "abs_max", "nonfinite"])
        {'mean': -0.3333333432674408, 'abs_max': 4.0, 'nonfinite': 0.0}
    """
    return State._make(states([observe(t)], t.device)[0].tolist())


def states(observations: Sequence[Observation], device: torch.device) -> torch.Tensor:
    """The ``(len(observations), WIDTH)`` float64 states of ``observations``, on ``device``, in a few kernels."""
    empty = torch.zeros(6, dtype=torch.float64, device=device)
    raw = torch.stack(
        [empty if o.raw is None else o.raw if o.raw.device == device else o.raw.to(device) for o in observations]
    )
    count = host_vector([o.numel for o in observations], torch.float64, device)
    return _state_table(count, raw)


def _state_table(count: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """States from element counts and rows in :class:`Observation`'s ``raw`` layout."""
    mean, spread, abs_max, abs_sum, nonzero, nonfinite = raw.unbind(1)
    total = mean * count
    sum_sq = torch.addcmul(spread * spread, total, mean)  # spread² + n·mean²
    return torch.stack([count, total, sum_sq, nonzero, nonfinite, abs_sum, abs_max], dim=1)


def state_row(t: torch.Tensor) -> torch.Tensor:
    """The float64 state of ``t`` as a ``WIDTH`` vector on its device, with no host value in it.

    What a hook inside a ``torch.compile``'d graph computes: the same numbers as :func:`observe`
    followed by :func:`states`, the element count included, so that the graph outputs the whole
    state (see :meth:`StatBatch.add_state`).
    """
    observation = observe(t)
    if observation.raw is None:
        return torch.zeros(WIDTH, dtype=torch.float64, device=t.device)
    count = torch.scalar_tensor(observation.numel, dtype=torch.float64, device=t.device)
    return _state_table(count.reshape(1), observation.raw.reshape(1, -1))[0]


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


def combine(rows: Iterable[State]) -> State:
    """One state for several on the host (a layer's weight and bias in a figure): ``+``, and ``max`` (NaN wins)."""
    rows = list(rows)
    summed = [math.fsum(column) for column in zip(*(r[:_SUMMED] for r in rows), strict=True)]
    peaks = [r.abs_max for r in rows if r.numel]
    peak = math.nan if any(math.isnan(p) for p in peaks) else max(peaks, default=0.0)
    return State._make([*summed, peak]) if rows else State()


def derive(state: State, stats: Sequence[str] = STATS) -> dict[str, float]:
    """The named statistics of a state (on the host); nothing for an empty one."""
    values = derive_many([state], stats)[0]
    return {} if values is None else dict(zip(stats, values, strict=True))


def derive_many(states: Sequence[State], stats: Sequence[str] = STATS) -> list[list[float] | None]:
    """The values of ``stats`` for each of ``states``, in that order (``None`` for an empty state), all at once.

    Example::

        >>> derive_many([state(torch.tensor([3.0, 0.0, -4.0])), State()], ["abs_max", "zero_frac"])
        [[4.0, 0.33333333333333337], None]
    """
    if not states:
        return []
    rows = derived_table(states, stats).tolist()
    return [row if s.numel else None for row, s in zip(rows, states, strict=True)]


def derived_table(states: Sequence[State], stats: Sequence[str] = STATS) -> torch.Tensor:
    """:func:`derive_many` as a float64 ``(len(states), len(stats))`` matrix (an empty state's row is NaN or 0)."""
    if not states:
        return torch.zeros(0, len(stats), dtype=torch.float64)
    # Packed as doubles: 1.1 M instructions for 486 states against 2.3 M through an array.array filled from the
    # same iterator (callgrind), itself half the time of torch.tensor over the tuples.
    values = bytearray(struct.pack(f"{len(states) * WIDTH}d", *itertools.chain.from_iterable(states)))
    table = torch.frombuffer(values, dtype=torch.float64).view(len(states), WIDTH)
    n, total, squares, nonzero, nonfinite, _, abs_max = table.unbind(1)
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


def abs_mean(state: State) -> float:
    """Mean absolute value (``nan`` for an empty state); the gradient-flow figure's bars."""
    return state.abs_sum / state.numel if state.numel else math.nan


def norm_total(states: Iterable[State]) -> float:
    """The 2-norm of all the tensors behind ``states`` together (``grad_norm_total``)."""
    return math.sqrt(math.fsum(max(s.sum_sq, 0.0) for s in states))


def sample(t: torch.Tensor) -> torch.Tensor:
    """At most :data:`HIST_SAMPLE` evenly strided elements of ``t``, copied (a later in-place op cannot change them)."""
    x = t.detach().flatten()
    if x.numel() > HIST_SAMPLE:
        x = x[:: math.ceil(x.numel() / HIST_SAMPLE)]
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32, copy=True)


def histogram(values: torch.Tensor, bins: int) -> torch.Tensor:
    """A float64 row ``[min, max, num, sum, sum_sq, count_0 .. count_{bins-1}]`` over the finite ``values``.

    ``bins`` equal buckets from the smallest to the largest finite value, the last one closed, as
    ``torch.histc`` lays them in the values' dtype; counted on device (``bincount``, or
    ``scatter_add`` where some values are not finite) so that nothing waits for the host on an
    accelerator.
    """
    return histogram_rows(values.detach().reshape(1, -1).clone(), bins)[0]


HIST_CHUNK = 1 << 17
""":func:`histograms` counts at most this many values at once (a few MB of temporaries, kept in cache)."""


def histograms(values: Sequence[torch.Tensor], bins: int) -> torch.Tensor:
    """``(len(values), 5 + bins)``: the :func:`histogram` of each of ``values`` (one device), in a number of
    operators that grows with the number of distinct lengths and dtypes, not of tensors: values of one length
    and dtype are stacked into a matrix, :data:`HIST_CHUNK` values at a time, and counted row by row. The
    matrices of one dtype reuse one buffer: fresh memory costs a page fault per 4 KB on CPU."""
    if not values:
        return torch.zeros(0, 5 + bins, dtype=torch.float64)
    first: dict[int, int] = {}
    """Each distinct tensor's position among them: a tensor given several times (one sample of an output that
    several modules return) is counted once."""
    at = [first.setdefault(id(v), len(first)) for v in values]
    if len(first) < len(values):
        distinct = list({id(v): v for v in values}.values())
        return histograms(distinct, bins)[host_vector(at, torch.int64, distinct[0].device)]
    by_length: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        by_length.setdefault((v.numel(), v.dtype), []).append(i)
    buffers: dict[torch.dtype, torch.Tensor] = {}
    rows: list[torch.Tensor] = [values[0]] * len(values)
    for (length, dtype), indices in by_length.items():
        per = max(1, HIST_CHUNK // max(length, 1))
        for start in range(0, len(indices), per):
            part = indices[start : start + per]
            size = len(part) * length
            buffer = buffers.get(dtype)
            if buffer is None or len(buffer) < size:
                buffer = buffers[dtype] = values[0].new_empty(max(size, HIST_CHUNK), dtype=dtype)
            matrix = torch.stack([values[i].reshape(-1) for i in part], out=buffer[:size].view(len(part), length))
            for i, row in zip(part, histogram_rows(matrix, bins).unbind(0), strict=True):
                rows[i] = row
    return torch.stack(rows)


def histogram_rows(x: torch.Tensor, bins: int) -> torch.Tensor:
    """:func:`histogram` of each row of the matrix ``x``, as a ``(rows, 5 + bins)`` float64 matrix; ``x`` is
    overwritten.

    Counted in ``x``'s dtype (float32 for every sample but a float64 tensor's), mostly in place: on
    the development VM an 8 x 16,384 matrix took 2.9 ms through a float64 copy and its temporaries
    (fresh memory, a page fault per 4 KB), 0.46 ms in float32 in place. On CPU, where reading a
    value costs no transfer, rows known to hold only finite values (their sum is finite) skip the
    masks that NaN and Inf need: ``isfinite`` and ``where`` are the slowest passes here (2 ns per
    element against 0.1 to 0.5 for a sum or an arithmetic op).
    """
    k, n = x.shape
    f64 = torch.float64
    if n == 0:
        return torch.zeros(k, 5 + bins, dtype=f64, device=x.device)
    total = x.sum(1, keepdim=True)
    offsets = torch.arange(0, k * bins, bins, dtype=torch.int32, device=x.device).unsqueeze(1)  # row r's buckets
    if surely_finite(total):
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        squares = torch.linalg.vector_norm(x, dim=1, keepdim=True).square_()  # a third of (x * x).sum(1)'s time
        position = x.sub_(lo).div_(torch.clamp(hi - lo, min=1e-12)).mul_(bins)  # >= 0: truncating is flooring
        # int32 indices: converting to them took half the time of int64 ones; bincount takes both
        index = position.int().clamp_(max=bins - 1).add_(offsets)
        counts = torch.bincount(index.view(-1), minlength=k * bins)
        return _histogram_table(n, lo, hi, total, squares, counts.view(k, bins))
    finite = torch.isfinite(x)
    lo = torch.where(finite, x, math.inf).amin(1, keepdim=True)
    hi = torch.where(finite, x, -math.inf).amax(1, keepdim=True)
    safe = torch.where(finite, x, 0.0)
    width = torch.clamp(hi - lo, min=1e-12)
    index = ((safe - lo) / width * bins).floor_().clamp_(0, bins - 1).long().add_(offsets)
    counts = torch.zeros(k * bins, dtype=f64, device=x.device)
    counts.scatter_add_(0, index.view(-1), finite.to(f64).view(-1))
    squares = torch.linalg.vector_norm(safe, dim=1, keepdim=True).square_()
    return _histogram_table(
        finite.sum(1, keepdim=True), lo, hi, safe.sum(1, keepdim=True), squares, counts.view(k, bins)
    )


def _histogram_table(
    num: int | torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    total: torch.Tensor,
    squares: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """:func:`histogram_rows`' float64 rows from their columns (``num`` a count for every row, or one per row)."""
    ends = torch.cat([lo, hi, total, squares], 1).to(torch.float64)
    num = ends.new_full((len(ends), 1), num) if isinstance(num, int) else num.to(torch.float64)
    return torch.cat([ends[:, :2], num, ends[:, 2:], counts.to(torch.float64)], 1)


class _RowField:
    """A number of a :class:`Histogram`, read from its row where it is."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __get__(self, hist: Histogram, owner: type | None = None) -> float:
        return float(hist.row[self.index])


class Histogram:
    """One key's histogram on the host, read as TensorBoard's ``add_histogram_raw`` takes it.

    ``row`` is what :func:`histogram` makes, ``[min, max, num, sum, sum_sq, count_0 .. count_{bins-1}]``:
    a row of the float64 array that :meth:`StatBatch.fetch` brings to the host, viewed, not copied
    (a writer can take the rows of a whole step as one array: see
    :class:`~lightning_hooks.sinks.events.HistogramSummaries`), or any sequence of floats. The fields are
    read from it on demand.

    Example::

        >>> hist = Histogram([0.0, 2.0, 3.0, 2.5, 4.25, 2.0, 1.0])
        >>> hist.num, hist.bucket_limits, hist.bucket_counts
        (3.0, [1.0, 2.0], [2.0, 1.0])
    """

    __slots__ = ("row",)

    def __init__(self, row: Row) -> None:
        self.row = row

    min, max, num, sum, sum_squares = (_RowField(i) for i in range(5))

    @property
    def bucket_counts(self) -> list[float]:
        return [float(count) for count in self.row[5:]]

    @property
    def bucket_limits(self) -> list[float]:
        """The right edge of each bucket: ``bins`` equal buckets from ``min`` to ``max``."""
        lo, hi, bins = self.min, self.max, len(self.row) - 5
        width = (hi - lo) / bins if hi > lo else 1e-12
        return [lo + width * (i + 1) for i in range(bins)]

    def as_dict(self) -> dict[str, float | list[float]]:
        """The fields by name (what a JSON file of histograms holds)."""
        return {
            "min": self.min,
            "max": self.max,
            "num": self.num,
            "sum": self.sum,
            "sum_squares": self.sum_squares,
            "bucket_limits": self.bucket_limits,
            "bucket_counts": self.bucket_counts,
        }


class Across(NamedTuple):
    """How :meth:`StatBatch.fetch` pools states over processes (DDP ranks, parameter shards).

    Every process calls ``fetch`` with the same ``groups``; ``agree`` turns this process's keys of
    those groups into the sorted union of every process's (a collective), and ``reduce(tensor, op)``
    is a collective with ``op`` in ``"sum"``, ``"max"``.
    """

    groups: frozenset[str]
    agree: Callable[[list[Key]], list[Key]]
    reduce: Callable[[torch.Tensor, str], torch.Tensor]


_LENGTH = "\0"
"""Separates a vector's name from its length in the keys processes agree on."""


class Fetched(NamedTuple):
    """A step's statistics on the host."""

    states: dict[Key, State]
    histograms: dict[Key, Histogram]
    scalars: dict[Key, float]
    vectors: dict[Key, list[float]] = {}


class _Bucket:
    """Float32 copies of tensors of one device and shape, the first ``taken`` rows of ``copies`` (a view of
    ``buffer``), waiting to be reduced together; ``rows[i]`` is the row of ``keys[i]``."""

    __slots__ = ("buffer", "capacity", "copies", "keys", "rows", "size", "slots", "taken")

    def __init__(self, buffer: torch.Tensor, shape: torch.Size) -> None:
        n = shape.numel()
        self.buffer = buffer
        self.size = buffer.numel()
        self.capacity = self.size // n
        """Rows in ``copies`` (ints kept: ``len()`` of a tensor is a Python-level call, asked at every copy)."""
        self.copies = buffer[: self.capacity * n].view(-1, *shape)
        self.slots: list[torch.Tensor] = []
        """Views of the first rows, made by one operator for several (see :meth:`slot`)."""
        self.taken = 0
        self.keys: list[Key] = []
        self.rows: list[int] = []

    def slot(self) -> torch.Tensor:
        """The view of the next free row: views are made 16 at a time, then twice as many as there are (a bucket of
        256 small rows that gets two copies makes 16 tensors, not 256)."""
        slots = self.slots
        if self.taken == len(slots):
            slots += self.copies[len(slots) : 2 * len(slots) or 16].unbind(0)
        return slots[self.taken]


class Block(NamedTuple):
    """Reduced tensors: ``raw`` has one row per tensor (:class:`Observation`'s layout), row ``r`` of ``numel[r]``
    elements; ``rows[i]`` is the row of ``keys[i]``."""

    keys: list[Key]
    rows: list[int]
    numel: list[int]
    raw: torch.Tensor


@dataclass
class StatBatch:
    """What a step records, kept on device and fetched with a single device-to-host copy.

    Observations under the same key (a module called twice, several micro-batches) are pooled.
    Nothing is taken unless ``open``: a tensor hook that fires after the batch was fetched (a
    late backward) adds nothing to the next one. Tensors of up to :data:`ROW_MAX` elements are
    copied and wait in ``queued``, by device and shape, to be reduced many at once (see
    :meth:`add`).
    """

    bins: int = 64
    open: bool = False
    observations: dict[Key, list[Observation]] = field(default_factory=dict)
    samples: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    extra: list[tuple[Sequence[Key], torch.Tensor]] = field(default_factory=list)
    """Scalars by key, a float64 vector of values per call of :meth:`add_scalars` (a later value of a key wins)."""
    vectors: dict[Key, torch.Tensor] = field(default_factory=dict)
    rows: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """States already computed (:func:`state_row`), pooled with the observations of their key."""
    queued: dict[tuple[torch.device, torch.Size], _Bucket] = field(default_factory=dict)
    """Copies waiting to be reduced, with their keys, by device and shape."""
    pending: int = 0
    """How many elements the buffers of ``queued`` hold."""
    blocks: list[Block] = field(default_factory=list)
    """Reduced buckets."""
    last: tuple[weakref.ref[torch.Tensor], int | None, _Bucket | Observation] | None = None
    """The tensor taken last (weakly: it is not kept alive), its version, and where it went (until its bucket is
    reduced)."""
    last_sample: torch.Tensor | None = None
    """The histogram sample of the tensor taken last, if one was taken."""
    spare: list[torch.Tensor] = field(default_factory=list)
    """CPU buffers of :data:`ROW_CHUNK` elements that reduced buckets gave back, for the next ones."""
    lean: bool = False
    """Reduce the copies with :func:`observe_norms`: for a caller that derives only ``norm``, ``mean``,
    ``abs_max`` and ``nonfinite`` from what it passes to :meth:`add` (larger tensors are observed in full)."""

    def __len__(self) -> int:
        scalars = len(dict.fromkeys(k for keys, _ in self.extra for k in keys))
        return len(self.observations) + len(self.samples) + scalars + len(self.vectors) + len(self.rows)

    def start(self) -> None:
        self.clear()
        self.open = True

    def clear(self) -> None:
        self.observations, self.samples, self.extra, self.vectors, self.rows = {}, {}, [], {}, {}
        self.queued, self.pending, self.blocks, self.last, self.spare = {}, 0, [], None, []
        self.last_sample = None
        self.open = False

    def add(self, key: Key, t: torch.Tensor, histogram: bool = False) -> None:
        """Observe ``t`` under ``key``, and keep a sample of it for the key's histogram if asked.

        A tensor of at most :data:`ROW_MAX` elements is copied (as float32, what :func:`observe`
        reduces: an in-place op after a forward hook, or autograd reusing a gradient's buffer,
        cannot change what was taken) into the bucket of its device and shape. A bucket is reduced
        by :func:`observe_rows` once its rows (:data:`ROW_CHUNK` elements) are full, all buckets
        once their buffers hold :data:`PENDING_MAX`, and whatever is left when the batch is
        fetched: the operators per tensor fall from a dozen to a copy. Larger tensors are reduced
        at once.

        The tensor taken just before, unchanged since (the same object at the same version), is not
        taken again: its row or observation is shared with the new key. That is a module whose
        output is its last child's (``nn.Sequential``, a block ending in a projection), and the two
        tensor hooks such a shared output gets in backward.
        """
        if not self.open:
            return
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor has no version: never shared
            version = None
        last = self.last
        if last is not None and last[0]() is t and version is not None and last[1] == version:
            self.observations.setdefault(key, [])
            if isinstance(last[2], _Bucket):
                last[2].keys.append(key)
                last[2].rows.append(last[2].rows[-1])
            else:
                self.observations[key].append(last[2])
        else:
            self._take(key, t, version)
            self.last_sample = None
        if histogram:
            taken = self.last_sample
            if taken is None:  # a shared tensor shares its sample too: :func:`histograms` counts it once
                taken = self.last_sample = sample(t)
            self.samples.setdefault(key, []).append(taken)

    def _take(self, key: Key, t: torch.Tensor, version: int | None) -> None:
        n = t.numel()
        if not 0 < n <= ROW_MAX:
            observation = observe(t)
            self.observations.setdefault(key, []).append(observation)
            self.last = (weakref.ref(t), version, observation)
            return
        where = (t.device, t.shape)
        bucket = self.queued.get(where)
        if bucket is None:
            bucket = self.queued[where] = _Bucket(self._buffer(t.device, n), t.shape)
            self.pending += bucket.size
        bucket.slot().copy_(t.detach())  # one pass; the matrix needs no stacking
        bucket.keys.append(key)
        bucket.rows.append(bucket.taken)
        bucket.taken += 1
        self.observations.setdefault(key, [])  # the key's place in call order
        self.last = (weakref.ref(t), version, bucket)
        if bucket.taken == bucket.capacity:
            self._reduce(where)
        elif self.pending >= PENDING_MAX:
            self.reduce_queued()

    def reduce_queued(self) -> None:
        """Reduce every bucket of copies (see :meth:`add`)."""
        for where in list(self.queued):
            self._reduce(where)

    def _reduce(self, where: tuple[torch.device, torch.Size]) -> None:
        bucket = self.queued.pop(where)
        k, n = bucket.taken, bucket.copies[0].numel()
        self.pending -= bucket.size
        self.last = None
        scratch = self._buffer(bucket.buffer.device, k * n)
        with torch.no_grad():
            reduce = observe_norms if self.lean else observe_rows
            raw = reduce(bucket.copies[:k].view(k, n), scratch[: k * n].view(k, n))
        self.blocks.append(Block(bucket.keys, bucket.rows, [n] * k, raw))
        if scratch.device.type == "cpu":  # done with them; on CUDA the caching allocator reuses memory anyway
            self.spare += [bucket.buffer, scratch]

    def _buffer(self, device: torch.device, size: int) -> torch.Tensor:
        """A float32 buffer of at least :data:`ROW_CHUNK` and ``size`` elements: a spare one on CPU, where fresh
        memory costs a page fault per 4 KB on first touch (on the encoder's logging step, about 3 ms of copies and
        reductions went to them)."""
        if self.spare and device.type == "cpu" and size <= ROW_CHUNK:
            return self.spare.pop()
        return torch.empty(max(size, ROW_CHUNK), dtype=torch.float32, device=device)

    def add_many(
        self,
        keys: Sequence[Key],
        tensors: Sequence[torch.Tensor],
        histogram: bool = False,
        layout: Chunks | None = None,
    ) -> None:
        """:meth:`add` for each key and tensor, reduced with fused kernels (see :func:`observe_many`); ``layout``:
        the tensors' :func:`chunks`, if known."""
        if self.open:
            for key in keys:  # their places in call order
                self.observations.setdefault(key, [])
            groups, singles = _observed_groups(tensors, layout)
            for indices, raw in groups:  # kept whole: no tensor and no observation per row
                numel = [tensors[i].numel() for i in indices]
                self.blocks.append(Block([keys[i] for i in indices], list(range(len(indices))), numel, raw))
            for i in singles:
                self.observations[keys[i]].append(observe(tensors[i]))
            if histogram:
                for key, t in zip(keys, tensors, strict=True):
                    self.samples.setdefault(key, []).append(sample(t))

    def add_state(self, key: Key, row: torch.Tensor, sampled: torch.Tensor | None = None) -> None:
        """Pool a state computed elsewhere (:func:`state_row`, a compiled graph's output) under ``key``,
        with a :func:`sample` of the tensor for the key's histogram if there is one."""
        if self.open:
            self.rows.setdefault(key, []).append(row)
            if sampled is not None:
                self.samples.setdefault(key, []).append(sampled)

    def add_scalar(self, key: Key, value: torch.Tensor) -> None:
        self.add_scalars([key], value)

    def add_scalars(self, keys: Sequence[Key], values: torch.Tensor) -> None:
        """:meth:`add_scalar` for each key, from one vector of values (kept whole: no tensor per key)."""
        if self.open:
            values = values.detach().double().reshape(-1)
            if values.numel() != len(keys):  # numel: len() of a tensor is a Python-level call
                raise ValueError(f"{len(keys)} keys for {values.numel()} values")
            self.extra.append((keys, values))

    def add_vector(self, key: Key, values: torch.Tensor) -> None:
        """A vector under ``key`` (e.g. how often each unit of a layer fired), pooled by ``+`` with the key's
        earlier vectors in the step and, for groups fetched ``across`` processes, with every process's."""
        if self.open:
            values = values.detach().double().reshape(-1)
            found = self.vectors.get(key)
            self.vectors[key] = values if found is None else found + values

    def fetch(self, across: Across | None = None) -> Fetched:
        """Pool, move everything to the host in one copy, and empty the batch."""
        self.reduce_queued()
        observations, samples, extra, vectors, rows, blocks = (
            self.observations,
            self.samples,
            self.extra,
            self.vectors,
            self.rows,
            self.blocks,
        )
        self.clear()  # closes the batch too
        device = next(
            (
                raw.device
                for raw in [*(b.raw for b in blocks), *(o.raw for obs in observations.values() for o in obs)]
                if raw is not None
            ),
            next(
                (
                    v.device
                    for v in [
                        *(v for _, v in extra),
                        *vectors.values(),
                        *(s[0] for s in [*samples.values(), *rows.values()]),
                    ]
                ),
                torch.device("cpu"),
            ),
        )
        local = list(dict.fromkeys([*observations, *rows]))
        shared: list[Key] = []
        shared_vectors: list[tuple[Key, int]] = []
        if across is not None:  # one agreement for the states and the vectors (a vector's key carries its length)
            mine = sorted(k for k in local if k[0] in across.groups)
            mine += sorted((g, f"{n}{_LENGTH}{v.numel()}") for (g, n), v in vectors.items() if g in across.groups)
            for group, name in across.agree(mine):
                if _LENGTH in name:
                    vector, _, length = name.rpartition(_LENGTH)
                    shared_vectors.append(((group, vector), int(length)))
                else:
                    shared.append((group, name))
            local = [k for k in local if k[0] not in across.groups]
        parts: list[torch.Tensor] = []
        if local:
            parts.append(_pooled(local, observations, rows, blocks, device))
        if shared:
            assert across is not None
            table = _pooled(shared, observations, rows, blocks, device)
            table[:, :_SUMMED] = across.reduce(table[:, :_SUMMED].contiguous(), "sum")
            table[:, _SUMMED:] = across.reduce(table[:, _SUMMED:].contiguous(), "max")
            parts.append(table)
        hist_keys = list(samples)
        if hist_keys:
            calls = [torch.cat(s) if len(s) > 1 else s[0] for s in samples.values()]
            parts.append(histograms([c.to(device) for c in calls], self.bins))
        scalar_keys = [k for keys, _ in extra for k in keys]
        if extra:  # one part, not one per scalar: the update ratios are one per parameter
            parts.append(torch.cat([v if v.device == device else v.to(device) for _, v in extra]))
        vector_keys = [(k, v.numel()) for k, v in vectors.items() if across is None or k[0] not in across.groups]
        parts.extend(vectors[k].to(device) for k, _ in vector_keys)
        if shared_vectors:
            assert across is not None
            zeros = torch.zeros(0, dtype=torch.float64, device=device)
            pooled = torch.cat(
                [vectors[k].to(device) if k in vectors else zeros.new_zeros(n) for k, n in shared_vectors]
            )
            parts.append(across.reduce(pooled, "sum"))
            vector_keys += shared_vectors
        if not parts:
            return Fetched({}, {}, {})
        # The one host transfer, read as a float64 array (a view of the host copy): the histograms stay rows of it,
        # and only the other values become Python floats (a Python float for each count of 1,200 histograms
        # of an encoder's step cost more than everything else in the step's host work).
        host = torch.cat([p.flatten() for p in parts]).detach().cpu().numpy()
        offset = (len(local) + len(shared)) * WIDTH
        fields = [iter(host[:offset].tolist())] * WIDTH  # the same iterator WIDTH times: zip takes a state's values
        # tuple.__new__ is what State._make calls, without its Python frame (each zip item has WIDTH values)
        made = map(functools.partial(tuple.__new__, State), zip(*fields, strict=True))
        found = dict(zip([*local, *shared], made, strict=True))
        size = len(hist_keys) * (5 + self.bins)
        hist_rows = host[offset : offset + size].reshape(len(hist_keys), 5 + self.bins)
        hists = dict(zip(hist_keys, map(Histogram, hist_rows), strict=True))
        rest = host[offset + size :].tolist()
        scalars = dict(zip(scalar_keys, rest[: len(scalar_keys)], strict=True))
        offset = len(scalar_keys)
        found_vectors: dict[Key, list[float]] = {}
        for key, size in vector_keys:
            found_vectors[key] = rest[offset : offset + size]
            offset += size
        return Fetched(found, hists, scalars, found_vectors)


def _pooled(
    keys: list[Key],
    observations: dict[Key, list[Observation]],
    rows: dict[Key, list[torch.Tensor]],
    blocks: list[Block],
    device: torch.device,
) -> torch.Tensor:
    """One state per key of ``keys``, on ``device`` (a key with nothing recorded is an empty state).

    The raw rows of every observation and reduced bucket are turned into states together: a
    handful of operators for the step, not a handful per bucket. When each key has one row, as on
    most steps, one gather puts the rows in the keys' order and nothing needs pooling.
    """
    position = {key: i for i, key in enumerate(keys)}
    index: list[int] = []
    """For each raw row taken: the position of its key (a row may serve several keys, a key have several rows)."""
    select: list[int] = []
    """For each raw row taken: where it is in the matrices of ``raws`` end to end."""
    counts: list[float] = []
    raws: list[torch.Tensor] = []
    listed = []
    for key, found in observations.items():  # most keys' observations are in blocks: their lists are empty
        if found and key in position:
            listed += [(position[key], o) for o in found]
    if listed:
        empty = torch.zeros(6, dtype=torch.float64, device=device)
        raws.append(
            torch.stack(
                [empty if o.raw is None else o.raw if o.raw.device == device else o.raw.to(device) for _, o in listed]
            )
        )
        index += [i for i, _ in listed]
        select += range(len(listed))
        counts += [float(o.numel) for _, o in listed]
    base = len(listed)
    for block in blocks:  # a bucket's keys may belong to groups fetched apart, a row to several keys
        at = [position.get(key, -1) for key in block.keys]
        raw = block.raw
        height = raw.shape[0]  # not len(): a Python-level call on a tensor
        if -1 not in at and len(block.rows) == height:  # every row once, in order: the usual block
            select += range(base, base + height)
            counts += block.numel
        else:
            kept = [j for j, i in enumerate(at) if i >= 0]
            if not kept:
                continue
            at = [at[j] for j in kept]
            select += [base + block.rows[j] for j in kept]
            counts += [block.numel[block.rows[j]] for j in kept]
        index += at
        raws.append(raw if raw.device == device else raw.to(device))
        base += height
    ready = [(position[key], r) for key, found in rows.items() if key in position for r in found]
    n = len(keys)
    if not raws and not ready:
        return torch.zeros(n, WIDTH, dtype=torch.float64, device=device)
    tables = []
    if raws:
        raw = torch.cat(raws) if len(raws) > 1 else raws[0]
        count = host_vector(counts, torch.float64, device)
        if not ready and len(index) == n and len(set(index)) == n:  # each key once: its row, in the keys' order
            if index != list(range(n)):
                at_key = torch.empty(n, dtype=torch.long, device=device)
                at_key[host_vector(index, torch.int64, device)] = torch.arange(n, device=device)
                count = count[at_key]
                select_t = host_vector(select, torch.int64, device)[at_key]
            elif select != list(range(base)):
                select_t = host_vector(select, torch.int64, device)
            else:
                return _state_table(count, raw)
            return _state_table(count, raw[select_t])
        if select != list(range(base)):
            raw = raw[host_vector(select, torch.int64, device)]
        tables.append(_state_table(count, raw))
    if ready:
        tables.append(torch.stack([r.to(device) for _, r in ready]))
        index += [i for i, _ in ready]
    table = torch.cat(tables) if len(tables) > 1 else tables[0]
    return pool(table, host_vector(index, torch.int64, device), n)
