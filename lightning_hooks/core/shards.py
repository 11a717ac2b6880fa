"""Sharded tensors (``DTensor``, as FSDP2's ``fully_shard`` makes parameters) seen shard by shard (pure torch)."""

from __future__ import annotations

import sys

import torch

__all__ = ["counted_part", "is_sharded", "local"]


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a tensor spread over processes)."""
    # No tensor can be a DTensor before its module was imported, so it is looked up, not imported.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: the local shard of a ``DTensor`` (its storage, so that in-place changes
    reach the ``DTensor``; ``to_local()`` would record an autograd node), ``t`` itself otherwise."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined]


def counted_part(t: torch.Tensor) -> torch.Tensor:
    """What this process adds to a statistic of ``t`` pooled over processes (never gathered): its local shard, or
    an empty tensor off mesh coordinate 0 of a replicated dimension (``t`` itself when not sharded)."""
    if not is_sharded(t):
        return t
    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate() or []
    replica = any(p.is_replicate() and c != 0 for p, c in zip(placements, coordinate, strict=False))
    shard = local(t)
    return shard[:0].flatten() if replica else shard
