"""Shapes and named tensors of nested module inputs and outputs, walked with ``torch.utils._pytree`` (dataclasses and
mappings it treats as opaque opened too); nothing here raises on an unknown type: it is shown by its type name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from lightning_hooks.core.shards import is_sharded, local

__all__ = ["Signature", "call_inputs", "format_signature", "leaf_shapes", "named_tensors", "signature"]

Leaf = tuple[int, ...] | str
"""A tensor's shape, or the type name of anything else (``"None"`` for ``None``)."""

Signature = tuple[tuple[str, Leaf], ...]
"""``(path, leaf)`` pairs in traversal order; hashable, holds no tensor."""

_MAX_DEPTH = 32


def _key(entry: Any) -> str:
    return next((str(getattr(entry, a)) for a in ("idx", "key", "name") if hasattr(entry, a)), str(entry))


def _opaque_container(obj: Any) -> bool:
    if obj is None or isinstance(obj, torch.Tensor):  # the usual leaves, decided without a question dynamo can't trace
        return False
    return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or (
        isinstance(obj, Mapping) and type(obj) not in pytree.SUPPORTED_NODES
    )


def _children(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return {str(k): v for k, v in obj.items()}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def named_leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf of a nested structure with its dotted path (``""`` for a bare leaf).

    Example::

        >>> [(p, type(v).__name__) for p, v in named_leaves((torch.zeros(2), {"h": None}))]
        [('0', 'Tensor'), ('1.h', 'NoneType')]
    """
    found: list[tuple[str, Any]] = []
    _leaves(obj, prefix, 0, found)
    return found


def _leaves(obj: Any, prefix: str, level: int, found: list[tuple[str, Any]]) -> None:
    # A list filled in, not a generator: a graph break inside a generator makes dynamo skip the whole frame.
    if type(obj) is torch.Tensor:  # what most modules take and return: a leaf, with no flattening to pay for
        found.append((prefix, obj))
        return
    try:
        flat, _ = pytree.tree_flatten_with_path(obj, is_leaf=_opaque_container)
    except Exception:  # a broken flatten function registered by someone else: show the object whole
        found.append((prefix, obj))
        return
    for path, leaf in flat:
        name = ".".join([prefix, *(_key(k) for k in path)] if prefix else [_key(k) for k in path])
        if level >= _MAX_DEPTH or not _opaque_container(leaf):
            found.append((name, leaf))
            continue
        try:
            children = _children(leaf)
        except Exception:  # a dataclass or mapping whose fields cannot be read
            found.append((name, leaf))
            continue
        for key, child in children.items():
            _leaves(child, f"{name}.{key}" if name else key, level + 1, found)


def named_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a nested structure with their dotted paths.

    Example::

        >>> [p for p, _ in named_tensors((torch.zeros(1), None, torch.ones(1)), prefix="lstm.out")]
        ['lstm.out.0', 'lstm.out.2']
    """
    return [(p, v) for p, v in named_leaves(obj, prefix) if isinstance(v, torch.Tensor)]


def describe(value: Any) -> Leaf:
    """A tensor's shape as a tuple of ints (a ``DTensor``'s whole shape, and this process's part where it is
    smaller: ``"[4, 6, 32] (local [4, 6, 16])"``); anything else by its type name."""
    if isinstance(value, torch.Tensor):
        shape = tuple(int(d) for d in value.shape)
        if is_sharded(value) and (part := tuple(int(d) for d in local(value).shape)) != shape:
            return f"{format_leaf(shape)} (local {format_leaf(part)})"
        return shape
    return "None" if value is None else type(value).__name__


def signature(obj: Any) -> Signature:
    """The shape signature of a nested structure: what a shape table shows, with no tensor held.

    Example::

        >>> signature({"logits": torch.zeros(4, 10), "aux": (None, 3)})
        (('logits', (4, 10)), ('aux.0', 'None'), ('aux.1', 'int'))
    """
    try:
        return tuple((path, describe(leaf)) for path, leaf in named_leaves(obj))
    except Exception:
        return (("", type(obj).__name__),)


def leaf_shapes(obj: Any) -> tuple[torch.Size, ...]:
    """The shapes of the tensors pytree finds in ``obj``: enough to tell whether the batch changed."""
    try:
        return tuple(leaf.shape for leaf in pytree.tree_leaves(obj) if isinstance(leaf, torch.Tensor))
    except Exception:
        return ()


def call_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a module was called with, in the form a table shows best: a lone positional argument as itself."""
    return args[0] if len(args) == 1 and not kwargs else {**{str(i): a for i, a in enumerate(args)}, **kwargs}


def format_leaf(leaf: Leaf) -> str:
    return "[" + ", ".join(str(d) for d in leaf) + "]" if isinstance(leaf, tuple) else leaf


def format_signature(sig: Signature) -> str:
    """``[32, 5]`` for a bare tensor, ``0: [32, 5], 1: [32]`` for several leaves.

    Example::

        >>> format_signature(signature((torch.zeros(32, 5), None)))
        '0: [32, 5], 1: None'
    """
    if not sig:
        return "()"
    if len(sig) == 1 and sig[0][0] == "":
        return format_leaf(sig[0][1])
    return ", ".join(f"{path}: {format_leaf(leaf)}" for path, leaf in sig)
