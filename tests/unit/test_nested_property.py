"""Property test: shape signatures of random nested structures."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hooks.core.nested import Leaf, format_signature, signature

Expected = list[tuple[str, Leaf]]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


@st.composite
def nested(draw: st.DrawFn, prefix: str = "", depth: int = 0) -> tuple[Any, Expected]:
    """A random structure and, built alongside it, the signature it must have."""
    kind = draw(
        st.sampled_from(["tensor", "int", "float", "str", "none"] + (["dict", "tuple", "list"] if depth < 3 else []))
    )
    if kind == "tensor":
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        return torch.zeros(shape), [(prefix, shape)]
    if kind in ("int", "float", "str", "none"):
        value = {
            "int": draw(st.integers()),
            "float": draw(st.floats()),
            "str": draw(st.text(max_size=3)),
            "none": None,
        }[kind]
        return value, [(prefix, "None" if value is None else type(value).__name__)]
    size = draw(st.integers(0, 3))
    if kind == "dict":
        keys = draw(st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=size, max_size=size, unique=True))
        children = {k: draw(nested(_join(prefix, k), depth + 1)) for k in keys}
        return {k: v for k, (v, _) in children.items()}, [e for _, exp in children.values() for e in exp]
    items = [draw(nested(_join(prefix, str(i)), depth + 1)) for i in range(size)]
    values = [v for v, _ in items]
    return (tuple(values) if kind == "tuple" else values), [e for _, exp in items for e in exp]


@settings(max_examples=200, deadline=None)
@given(nested())
def test_signature_matches_the_structure(case: tuple[Any, Expected]) -> None:
    value, expected = case
    assert list(signature(value)) == expected
    assert isinstance(format_signature(signature(value)), str)


@settings(max_examples=200, deadline=None)
@given(nested())
def test_signature_round_trips_through_the_structure(case: tuple[Any, Expected]) -> None:
    # Rebuild the structure from its signature alone (tensors of the recorded shapes, other leaves
    # as they were): the rebuilt structure has the same signature.
    value, _ = case
    leaves, spec = pytree.tree_flatten(value)
    described = [leaf for _, leaf in signature(value)]
    rebuilt_leaves = [
        torch.empty(d) if isinstance(d, tuple) else leaf for d, leaf in zip(described, leaves, strict=True)
    ]
    assert signature(pytree.tree_unflatten(rebuilt_leaves, spec)) == signature(value)
