import pickle

import pytest
import torch
from torch import nn

from lightning_hooks._handles import HookHandles


def _noop(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    return None


def test_add_len_and_remove_is_idempotent() -> None:
    layer = nn.Linear(2, 2)
    handles = HookHandles()
    handles.add(layer.register_forward_hook(_noop))
    handles.add(layer.weight.register_hook(lambda g: g))
    assert len(handles) == 2
    assert len(layer._forward_hooks) == 1
    handles.remove()
    handles.remove()
    assert len(handles) == 0
    assert len(layer._forward_hooks) == 0
    assert not layer.weight._backward_hooks


def test_context_manager_removes_on_error() -> None:
    layer = nn.Linear(2, 2)

    def fail() -> None:
        with HookHandles() as handles:
            handles.add(layer.register_forward_hook(_noop))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert len(layer._forward_hooks) == 0


def test_pickles_and_copy_owns_nothing() -> None:
    layer = nn.Linear(2, 2)
    handles = HookHandles()
    handles.add(layer.register_forward_hook(_noop))
    copy = pickle.loads(pickle.dumps(handles))
    assert len(copy) == 0
    assert len(handles) == 1
    handles.remove()
    assert len(pickle.loads(pickle.dumps(handles))) == 0
