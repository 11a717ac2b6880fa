import pickle

import pytest
import torch
from torch import nn

from lightning_hooks.core.handles import HookHandles, observers_asleep


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


class OwnRegistration(nn.Linear):
    """Registers forward hooks its own way (as some wrappers do): counts them."""

    registered = 0

    def register_forward_hook(self, hook, **kwargs):  # type: ignore[no-untyped-def]
        type(self).registered += 1
        return super().register_forward_hook(hook, **kwargs)


def test_forward_hooks_go_through_public_registration_run_in_order_and_all_go() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), OwnRegistration(3, 2))
    calls: list[str] = []

    def tap(label: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            calls.append(label)

        return hook

    users = [model[0].register_forward_hook(tap("user before"))]
    handles = HookHandles()
    # model[0] twice: the second hook must not replace the first
    handles.add_forward_hooks(
        [(model[0], tap("0")), (model[1], tap("1")), (model[2], tap("2")), (model[0], tap("0 again"))]
    )
    users.append(model[0].register_forward_hook(tap("user after")))
    assert OwnRegistration.registered == 1
    assert len(handles) == 4
    model(torch.ones(1, 2))
    assert calls == ["user before", "0", "0 again", "user after", "1", "2"]
    handles.remove()
    calls.clear()
    model(torch.ones(1, 2))
    assert calls == ["user before", "user after"]
    for handle in users:
        handle.remove()
    assert all(not m._forward_hooks for m in model.modules())


class Failing(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("forward failed")


def test_pre_hooks_with_kwargs_and_always_called_hooks() -> None:
    # What ShapeRecorder registers: a pre-hook that sees keyword arguments, a hook that runs even when forward raises.
    model = nn.ModuleDict({"ok": nn.Linear(2, 2), "failing": Failing(2, 2)})
    seen: list[tuple[str, object]] = []

    def pre(label: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.append((label, sorted(kwargs)))

        return hook

    def post(label: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            seen.append((label, "after"))

        return hook

    handles = HookHandles()
    handles.add_forward_pre_hooks([(m, pre(n)) for n, m in model.items()], with_kwargs=True)
    handles.add_forward_hooks([(m, post(n)) for n, m in model.items()], always_call=True)
    model["ok"](input=torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="forward failed"):
        model["failing"](input=torch.ones(1, 2))
    assert seen == [(name, when) for name in ("ok", "failing") for when in (["input"], "after")]
    handles.remove()
    hook_dicts = (
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
    )
    assert all(not getattr(m, d) for m in model.modules() for d in hook_dicts)


def test_observers_sleep_and_the_users_hooks_do_not() -> None:
    layer, calls = nn.Linear(2, 2), []
    user = layer.register_forward_hook(lambda *_: calls.append("user"))
    with HookHandles() as handles:
        handles.add_forward_hooks([(layer, lambda *_: calls.append("observer"))])
        with observers_asleep(), observers_asleep():  # nested: asleep until the outermost ends
            layer(torch.ones(1, 2))
        layer(torch.ones(1, 2))
    user.remove()
    assert calls == ["user", "user", "observer"]
