"""What a logging step records, kept on device and brought to the host in one transfer (pure torch)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple

import torch

from lightning_hooks.core.select import output_label
from lightning_hooks.core.shards import counted_part, is_sharded
from lightning_hooks.stats.histogram import Histogram, histogram_rows, sample
from lightning_hooks.stats.state import (
    RAW_WIDTH,
    STATS,
    WIDTH,
    State,
    derive_table,
    pool,
    raw_pieces,
    raw_rows,
    raw_states,
    real_view,
)

__all__ = ["Across", "Fetched", "Key", "OutputKeys", "StatBatch", "sample"]

Key = tuple[str, str]
"""``(group, name)``: what a state is of, e.g. ``("param", "fc1.weight")``."""

ROW_MAX = 1 << 15
"""A tensor of at most this many elements is copied into a slab with the others of its shape; a larger one is
reduced at once."""

SLAB_BYTES = 1 << 20
"""A slab holds this many bytes of float32 copies (at least one row) and is reduced as soon as it is full, while it is
still in the CPU's cache (docs/performance.md, "CPU time of a logging step")."""

SLABS_OPEN = 16
"""At most this many slabs are filled at once (16 MB): a new shape beyond them has every open slab reduced first."""


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


class Across(NamedTuple):
    """How :meth:`StatBatch.fetch` pools ``groups`` over processes: ``agree`` turns this process's keys into the
    sorted union of every process's, ``reduce(tensor, op)`` with ``op`` in ``"sum"``, ``"max"``; both collectives.

    Under tensor parallelism ``replicas(tensor)`` stacks the tensor of every process of this one's tensor-parallel
    group (a collective), and ``replica`` is this process's place in it. A layer's output that is a plain tensor says
    nothing of its layout: it is taken as replicated (counted once) when the state of that layer's forward output is
    the same on the whole group, and as a shard (added up) otherwise. ``outputs`` maps each group of such states to
    the group that holds the forward states deciding it (``{"act": "act", "out": "fwd"}``)."""

    groups: frozenset[str]
    agree: Callable[[list[tuple[Hashable, ...]]], list[tuple[Hashable, ...]]]
    reduce: Callable[[torch.Tensor, str], torch.Tensor]
    replicas: Callable[[torch.Tensor], torch.Tensor] | None = None
    replica: int = 0
    outputs: Mapping[str, str] = {}
    per_unit: frozenset[Key] = frozenset()
    """Vectors of one value per unit of an output: where the group's copies differ, the units are split between
    them, and the vectors are joined end to end (other vectors of ``outputs`` groups that differ are added up)."""


class Fetched(NamedTuple):
    """A step's numbers on the host; ``stats`` holds each key's :data:`~lightning_hooks.stats.state.STATS`."""

    states: dict[Key, State]
    stats: dict[Key, list[float]]
    histograms: dict[Key, Histogram]
    scalars: dict[Key, float]
    vectors: dict[Key, list[float]]
    parts: Mapping[Key, int] = {}
    """Under tensor parallelism, for a vector of an output's shards added up over the group: how many parts."""


class StatBatch:
    """What a step records, pooled per key, fetched with a single device-to-host copy.

    Calls under the same key pool into one state. Nothing is taken unless the batch is ``open``.

    Example::

        >>> batch = StatBatch()
        >>> batch.start()
        >>> batch.add(("act", "fc"), torch.tensor([3.0, 0.0, -4.0]))
        >>> batch.add(("act", "fc"), torch.tensor([1.0]))
        >>> batch.fetch().states[("act", "fc")].numel
        4.0
    """

    def __init__(self, bins: int = 64) -> None:
        self.bins = bins
        self.open = False
        self.clear()

    def start(self) -> None:
        self.clear()
        self.open = True

    def clear(self) -> None:
        self.open = False
        self._order: dict[Key, None] = {}
        """Every key with a state, in the order of its first call."""
        self._raw: list[tuple[list[Key], torch.Tensor, list[int]]] = []
        """Reduced rows (:func:`raw_rows`; zeros for an empty tensor), their keys and each row's count of values: made
        states at :meth:`fetch`."""
        self._slabs: dict[tuple[torch.device, torch.Size], tuple[list[Key], torch.Tensor]] = {}
        """Per device and shape, the slab of float32 copies being filled, with the keys of its rows so far."""
        self._reduced: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor, list[int]]] = {}
        """Per tensor reduced at once, by the ``id`` of its source: the source (weakly), its version and the rows."""
        self._samples: dict[Key, list[torch.Tensor]] = {}
        self._scalars: list[tuple[Sequence[Key], torch.Tensor]] = []
        self._vectors: dict[Key, torch.Tensor] = {}
        self._device: torch.device | None = None

    def add(self, key: Key, t: torch.Tensor, histogram: bool = False) -> None:
        """Take the state of ``t`` under ``key`` (later in-place ops do not change it), and a sample for the key's
        histogram if asked."""
        if not self.open:
            return
        self._order[key] = None
        x = real_view(t.detach())
        self._take([key], [counted_part(x, copies_off_mesh=False) if is_sharded(x) else x], histogram, [t])

    def add_many(self, keys: Sequence[Key], tensors: Sequence[torch.Tensor], histogram: bool = False) -> None:
        """:meth:`add` for each key and tensor."""
        if not self.open:
            return
        groups: dict[tuple[torch.device, torch.Size], tuple[list[Key], list[torch.Tensor]]] = {}
        for key, t in zip(keys, tensors, strict=True):
            self._order[key] = None
            t = real_view(t)
            group_keys, group = groups.setdefault((t.device, t.shape), ([], []))
            group_keys.append(key)
            group.append(t)
        with torch.no_grad():
            for group_keys, group in groups.values():
                self._take(group_keys, group, histogram)

    def _take(
        self, keys: list[Key], tensors: list[torch.Tensor], histogram: bool, sources: list[torch.Tensor] | None = None
    ) -> None:
        """Copy the rows of ``tensors`` (of one device and shape) into their shape's slab or, if they are large,
        reduce each at once: once per ``source`` (the tensor each was taken from) met again unchanged."""
        first = tensors[0]
        self._device = self._device or first.device
        n, k = first.numel(), len(tensors)
        if 0 < n <= ROW_MAX:
            slot = (first.device, first.shape)
            rows = max(1, SLAB_BYTES // (4 * n))
            done = 0
            while done < k:
                if slot not in self._slabs:
                    if len(self._slabs) == SLABS_OPEN:
                        self._reduce_slabs()
                    self._slabs[slot] = ([], first.new_empty((rows, *first.shape), dtype=torch.float32))
                slab_keys, slab = self._slabs[slot]
                used = len(slab_keys)
                taken = min(k - done, rows - used)
                part = tensors[done : done + taken]
                slab[used : used + taken].copy_(torch.stack(part) if taken > 1 else part[0])  # one fills its row
                slab_keys.extend(keys[done : done + taken])
                done += taken
                if used + taken == rows:
                    self._reduce_slab(slot)
        elif n:
            for key, t, source in zip(keys, tensors, sources or tensors, strict=True):
                raw, sizes = self._reduced_once(t, source)
                self._raw.append(([key] * len(sizes), raw, sizes))
        else:
            self._raw.append((list(keys), first.new_zeros(len(keys), RAW_WIDTH, dtype=torch.float32), [0] * len(keys)))
        if histogram:
            for key, t in zip(keys, tensors, strict=True):
                self._samples.setdefault(key, []).append(sample(t))

    def _reduced_once(self, t: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """:func:`raw_pieces` of ``t``, taken from ``source``; the same rows again while ``source`` is that object at
        that version (a container returns its last child's output, an addition hands one gradient to both its inputs:
        a fifth of GPT-2's outputs and output gradients reach a batch twice)."""
        found = self._reduced.get(id(source))
        if found is None or found[0]() is not source or found[1] != source._version:
            found = self._reduced[id(source)] = (weakref.ref(source), source._version, *raw_pieces(t))
        return found[2], found[3]

    def _reduce_slabs(self) -> None:
        for slot in list(self._slabs):
            self._reduce_slab(slot)

    def _reduce_slab(self, slot: tuple[torch.device, torch.Size]) -> None:
        keys, slab = self._slabs.pop(slot)
        rows = slab[: len(keys)].reshape(len(keys), -1)
        self._raw.append((keys, raw_rows(rows), [rows.shape[1]] * len(keys)))

    def add_raw(self, key: Key, raw: torch.Tensor, n: int, sampled: torch.Tensor | None = None) -> None:
        """Pool the :func:`~lightning_hooks.stats.state.raw_rows` row of a tensor of ``n`` values reduced elsewhere
        (in a compiled graph) under ``key``, with a :func:`sample` of it for the key's histogram if there is one."""
        if self.open:
            self._order[key] = None
            self._device = self._device or raw.device
            self._raw.append(([key], raw.reshape(1, -1), [n]))
            if sampled is not None:
                self._samples.setdefault(key, []).append(sampled)

    def add_scalar(self, key: Key, value: torch.Tensor) -> None:
        self.add_scalars([key], value)

    def add_scalars(self, keys: Sequence[Key], values: torch.Tensor) -> None:
        """One value per key from one vector (a later value of a key wins)."""
        if self.open:
            values = values.detach().double().flatten()
            if values.numel() != len(keys):
                raise ValueError(f"{len(keys)} keys for {values.numel()} values")
            self._device = self._device or values.device
            self._scalars.append((keys, values))

    def add_vector(self, key: Key, values: torch.Tensor) -> None:
        """A vector under ``key``, pooled by ``+`` with the key's earlier vectors and (fetched ``across``) processes."""
        if self.open:
            values = values.detach().double().flatten()
            self._device = self._device or values.device
            found = self._vectors.get(key)
            self._vectors[key] = values if found is None else found + values

    def fetch(self, across: Across | None = None) -> Fetched:
        """Pool, derive, move everything to the host in one copy, and empty the batch."""
        self._reduce_slabs()
        device = self._device or torch.device("cpu")
        keys = list(self._order)
        vector_keys = list(self._vectors)
        shared: list[Key] = []
        shared_vectors: list[tuple[Key, int]] = []
        if across is not None:  # the keys every process fetches, agreed in one collective
            mine: list[tuple[Hashable, ...]] = sorted(k for k in keys if k[0] in across.groups)
            mine += sorted((g, n, v.numel()) for (g, n), v in self._vectors.items() if g in across.groups)
            for agreed in across.agree(mine):
                if len(agreed) == 2:
                    shared.append((str(agreed[0]), str(agreed[1])))
                else:
                    shared_vectors.append(((str(agreed[0]), str(agreed[1])), int(agreed[2])))  # type: ignore[call-overload]
            keys = [k for k in keys if k[0] not in across.groups]
            vector_keys = [k for k in vector_keys if k[0] not in across.groups]
        table = self._pooled([*keys, *shared], device)
        if shared:
            assert across is not None
            part = table[len(keys) :]
            if across.replicas is not None:
                copies = _replicated(part, shared, across)  # collectives: every process of the group takes part
                if across.replica != 0:
                    part[copies] = 0.0
            part[:, :-1] = across.reduce(part[:, :-1].contiguous(), "sum")
            part[:, -1:] = across.reduce(part[:, -1:].contiguous(), "max")
        keys += shared
        parts = [table.flatten(), derive_table(table).flatten()] if len(keys) else []  # no states: nothing to derive
        hist_keys = list(self._samples)
        if hist_keys:
            parts.append(self._histograms(hist_keys, device).flatten())
        scalar_keys = [k for ks, _ in self._scalars for k in ks]
        parts += [values.to(device) for _, values in self._scalars]
        vectors = [(k, self._vectors[k]) for k in vector_keys]
        parts_of: dict[Key, int] = {}
        if shared_vectors:
            assert across is not None
            pooled = [
                self._vectors[k] if k in self._vectors else torch.zeros(n, dtype=torch.float64)
                for k, n in shared_vectors
            ]
            if across.replicas is not None:
                pooled, shared_vectors, parts_of = _tensor_parallel_vectors(
                    [v.to(device) for v in pooled], shared_vectors, across
                )
            joined = across.reduce(torch.cat([v.to(device) for v in pooled]), "sum")
            vectors += list(
                zip([k for k, _ in shared_vectors], joined.split([n for _, n in shared_vectors]), strict=True)
            )
        parts += [v.to(device) for _, v in vectors]
        self.clear()
        host = torch.cat(parts).cpu().tolist() if parts else []  # the one host transfer
        fetched = self._read(host, keys, hist_keys, scalar_keys, [(k, v.numel()) for k, v in vectors])
        return fetched._replace(parts=parts_of) if parts_of else fetched

    def _pooled(self, keys: list[Key], device: torch.device) -> torch.Tensor:
        """One state per key of ``keys`` (a key with nothing recorded here is an empty state)."""
        if not self._raw:
            return torch.zeros(len(keys), WIDTH, dtype=torch.float64, device=device)
        raw = torch.cat([rows.to(device) for _, rows, _ in self._raw])
        sizes = torch.tensor([n for _, _, ns in self._raw for n in ns], dtype=torch.float64, device=device)
        position = {key: i for i, key in enumerate(keys)}
        index = [position[key] for block_keys, _, _ in self._raw for key in block_keys]
        return pool(raw_states(raw, sizes), torch.tensor(index, device=device), len(keys))

    def _histograms(self, keys: list[Key], device: torch.device) -> torch.Tensor:
        """The histogram rows of ``keys``, in order; samples of one length and dtype are counted as one matrix."""
        values = [torch.cat(s).to(device) if len(s) > 1 else s[0].to(device) for s in (self._samples[k] for k in keys)]
        by_length: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, v in enumerate(values):
            by_length.setdefault((v.numel(), v.dtype), []).append(i)
        rows = torch.empty(len(values), 5 + self.bins, dtype=torch.float64, device=device)
        for indices in by_length.values():
            rows[indices] = histogram_rows(torch.stack([values[i] for i in indices]), self.bins)
        return rows

    def _read(
        self,
        host: list[float],
        keys: list[Key],
        hist_keys: list[Key],
        scalar_keys: list[Key],
        vector_sizes: list[tuple[Key, int]],
    ) -> Fetched:
        """Split the host copy back into its parts."""
        at = 0

        def take(n: int) -> list[float]:
            nonlocal at
            at += n
            return host[at - n : at]

        states = {key: State._make(take(WIDTH)) for key in keys}
        stats = {key: take(len(STATS)) for key in keys}
        stats = {key: values for key, values in stats.items() if states[key].numel}
        histograms = {key: Histogram.of(take(5 + self.bins)) for key in hist_keys}
        scalars = dict(zip(scalar_keys, take(len(scalar_keys)), strict=True))
        vectors = {key: take(n) for key, n in vector_sizes}
        return Fetched(states, stats, histograms, scalars, vectors)


def _replicated(states: torch.Tensor, keys: list[Key], across: Across) -> torch.Tensor:
    """Per row of ``states`` (of ``keys``), whether it is a copy of a tensor replicated over the tensor-parallel group:
    an output whose deciding forward state is the same on every process of the group (NaN equal to NaN), judged
    alike on every process. Other rows are never copies (a sharded parameter's parts were counted once already)."""
    assert across.replicas is not None
    copies = across.replicas(states.contiguous())
    same = (copies == states) | (copies.isnan() & states.isnan())
    alike = across.reduce((~same).any(2).any(0).double(), "max") == 0
    row = {key: i for i, key in enumerate(keys)}
    decider = [row.get((across.outputs[group], name), -1) if group in across.outputs else -1 for group, name in keys]
    index = torch.tensor(decider, device=states.device)
    return torch.where(index >= 0, alike[index.clamp_min(0)], False)


def _tensor_parallel_vectors(
    vectors: list[torch.Tensor], sizes: list[tuple[Key, int]], across: Across
) -> tuple[list[torch.Tensor], list[tuple[Key, int]], dict[Key, int]]:
    """What this process adds to each shared vector's sum over every process under tensor parallelism, the new
    sizes, and the parts of the vectors added up over the group. A vector of an ``outputs`` group alike on the whole
    tensor-parallel group is a copy, added once; one that differs is of shards: joined end to end if
    ``per_unit`` (every process of the group holds the joined vector, the first adds it), else added up."""
    assert across.replicas is not None
    flat = torch.cat(vectors)
    copies = across.replicas(flat)
    same = (copies == flat) | (copies.isnan() & flat.isnan())
    starts = [0]
    for _, n in sizes:
        starts.append(starts[-1] + n)
    differs = torch.stack([(~same[:, a:b]).any() for a, b in zip(starts, starts[1:], strict=False)]).double()
    split = (across.reduce(differs, "max") > 0).tolist()  # decided alike on every process: the one read
    out: list[torch.Tensor] = []
    new_sizes: list[tuple[Key, int]] = []
    parts: dict[Key, int] = {}
    first = across.replica == 0
    for (key, n), vector, a, shards in zip(sizes, vectors, starts[:-1], split, strict=True):
        if key[0] not in across.outputs:
            out.append(vector)
        elif not shards:
            out.append(vector if first else torch.zeros_like(vector))
        elif key in across.per_unit:
            joined = copies[:, a : a + n].reshape(-1)
            out.append(joined if first else torch.zeros_like(joined))
        else:
            out.append(vector)
            parts[key] = copies.shape[0]
        new_sizes.append((key, out[-1].numel()))
    return out, new_sizes, parts
