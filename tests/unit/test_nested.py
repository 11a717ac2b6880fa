from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from lightning_hooks.core.nested import call_inputs, format_signature, named_tensors, signature

Pair = namedtuple("Pair", "first second")


@dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...] | None = None


class ModelOutput(OrderedDict):
    """Shaped like ``transformers.utils.ModelOutput``: an OrderedDict subclass pytree does not know."""


class Opaque:
    def __len__(self) -> int:
        raise RuntimeError("not a container")


T = torch.zeros


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (T(2, 3), (("", (2, 3)),)),
        (T(()), (("", ()),)),
        (None, (("", "None"),)),
        (3, (("", "int"),)),
        ("text", (("", "str"),)),
        ((T(1), None, 2.0), (("0", (1,)), ("1", "None"), ("2", "float"))),
        ([T(1), [T(2)]], (("0", (1,)), ("1.0", (2,)))),
        ({"a": T(1), "b": {"c": T(2)}}, (("a", (1,)), ("b.c", (2,)))),
        (Pair(T(1), T(2)), (("first", (1,)), ("second", (2,)))),
        (Output(T(4, 2), (T(1),)), (("logits", (4, 2)), ("hidden.0", (1,)))),
        (ModelOutput(loss=T(()), logits=T(2, 5)), (("loss", ()), ("logits", (2, 5)))),
        (
            [Output(T(1)), ModelOutput(x=Pair(T(3), None))],
            (("0.logits", (1,)), ("0.hidden", "None"), ("1.x.first", (3,)), ("1.x.second", "None")),
        ),
        (Opaque(), (("", "Opaque"),)),
        ((), ()),
    ],
)
def test_signature(value: object, expected: tuple) -> None:
    assert signature(value) == expected


def test_named_tensors_keeps_only_tensors_with_paths() -> None:
    a, b = T(1), T(2)
    found = named_tensors((a, {"h": (None, b)}), prefix="lstm.out")
    assert [p for p, _ in found] == ["lstm.out.0", "lstm.out.1.h.1"]
    assert found[0][1] is a
    assert found[1][1] is b


@pytest.mark.parametrize(
    ("value", "paths"),
    [
        (T(2), [""]),
        ((T(2),), ["0"]),
        ((T(2), None, T(3)), ["0", "2"]),
        ((), []),
        (Pair(T(1), T(2)), ["first", "second"]),
        ([T(1), 3, T(2)], ["0", "2"]),
        ({"query": T(1), "attn_mask": None, "need_weights": False, "b": T(2)}, ["query", "b"]),
        ({1: T(1), "x": "text"}, ["1"]),
        ((T(1), (T(2),)), ["0", "1.0"]),
        ({"h": [T(1)]}, ["h.0"]),
    ],
    ids=["tensor", "1-tuple", "tuple-none", "empty", "namedtuple", "list", "kwargs", "int-key", "nested", "dict-list"],
)
def test_named_tensors_paths(value: object, paths: list[str]) -> None:
    assert [p for p, _ in named_tensors(value)] == paths
    assert [p for p, _ in named_tensors(value, "out")] == [f"out.{p}" if p else "out" for p in paths]


def test_packed_sequence_is_shown_by_its_fields() -> None:
    packed = torch.nn.utils.rnn.pack_padded_sequence(T(3, 2, 4), torch.tensor([3, 1]), batch_first=False)
    paths = [p for p, _ in signature(packed)]
    assert paths[:2] == ["data", "batch_sizes"]


@pytest.mark.parametrize(
    ("args", "kwargs", "text"),
    [
        ((T(32, 5),), {}, "[32, 5]"),
        (((T(32, 5), T(32)),), {}, "0: [32, 5], 1: [32]"),
        ((T(2),), {"mask": None}, "0: [2], mask: None"),
        ((), {}, "()"),
    ],
)
def test_call_inputs_format(args: tuple, kwargs: dict, text: str) -> None:
    assert format_signature(signature(call_inputs(args, kwargs))) == text
