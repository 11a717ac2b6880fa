"""Sharded tensors (``DTensor``, as FSDP2's ``fully_shard`` makes parameters) seen shard by shard (pure torch)."""

from __future__ import annotations

import sys

import torch

__all__ = ["counted_part", "is_sharded", "local", "replica_part", "summed"]


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a tensor spread over processes)."""
    # No tensor can be a DTensor before its module was imported, so it is looked up, not imported.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: the local shard of a ``DTensor`` (its storage, so that in-place changes
    reach the ``DTensor``; ``to_local()`` would record an autograd node), ``t`` itself otherwise."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined]


def summed(t: torch.Tensor) -> torch.Tensor:
    """The ``DTensor`` ``t`` with its values still to be summed (``Partial``) summed, ``Replicate`` on those mesh
    dimensions: a collective every process of the mesh must run (``t`` itself when nothing is pending)."""
    placements = t.placements  # type: ignore[attr-defined]
    if not any(p.is_partial() for p in placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in placements])  # type: ignore[attr-defined]


def counted_part(t: torch.Tensor, copies_off_mesh: bool = True) -> torch.Tensor:
    """What this process adds to a statistic of ``t`` pooled over every process (never gathered): its local shard,
    or an empty tensor where that shard is a copy counted elsewhere (``t`` itself when not sharded).

    A shard is a copy off mesh coordinate 0 of a ``Replicate`` dimension; with ``copies_off_mesh``, also off the copy
    of ``t``'s mesh that holds global rank 0 when the mesh is part of a larger world: a parameter's gradient under
    tensor parallelism, where FSDP2 spreads a norm's weight over the data-parallel ranks only and each
    tensor-parallel rank holds a copy (not a layer's output, whose copies of the mesh see other batches). Values
    still to be summed (``Partial``) are summed first, a collective every process of the mesh must run."""
    if not is_sharded(t):
        return t
    t = summed(t)
    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate() or []
    copy = any(p.is_replicate() and c != 0 for p, c in zip(placements, coordinate, strict=False))
    if copies_off_mesh and mesh.size() < torch.distributed.get_world_size():
        copy = copy or 0 not in mesh.mesh
    shard = local(t)
    return shard[:0].flatten() if copy else shard


def replica_part(t: torch.Tensor) -> torch.Tensor:
    """What this process adds to a statistic of a plain tensor that every process holds alike, pooled over them:
    ``t`` on global rank zero, an empty tensor elsewhere."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return t if rank == 0 else t[:0].flatten()
