"""The single owner of the ``RemovableHandle`` objects a callback creates, and the observers' sleep switch."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.core.autograd import in_transform

__all__ = ["HookHandles", "Observer", "made_once", "observers_asleep"]


class HookHandles:
    """Owns hook handles so that one call (:meth:`remove`, or leaving a ``with`` block) removes all of them.

    Example::

        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> with HookHandles() as handles:
        ...     _ = handles.add(layer.register_forward_hook(lambda m, i, o: None))
        ...     len(handles), len(layer._forward_hooks)
        (1, 1)
        >>> len(handles), len(layer._forward_hooks)
        (0, 0)
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle

    def add_forward_hooks(
        self, hooks: Sequence[tuple[nn.Module, Callable[..., Any]]], always_call: bool = False, prepend: bool = False
    ) -> None:
        """``module.register_forward_hook(hook, always_call=..., prepend=...)`` for each pair, the hook as an
        :class:`Observer`."""
        for module, hook in hooks:
            self.add(module.register_forward_hook(Observer(hook), always_call=always_call, prepend=prepend))

    def add_forward_pre_hooks(
        self, hooks: Sequence[tuple[nn.Module, Callable[..., Any]]], with_kwargs: bool = False
    ) -> None:
        """:meth:`add_forward_hooks` with ``register_forward_pre_hook(hook, with_kwargs=...)``."""
        for module, hook in hooks:
            self.add(module.register_forward_pre_hook(Observer(hook), with_kwargs=with_kwargs))

    def remove(self) -> None:
        """Remove every hook this owner holds; safe to call any number of times."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> HookHandles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to another process (ddp_spawn, checkpoint) carries no handle of a live module.
        return {"_handles": []}


class Observer:
    """A module hook that only watches: calls ``hook`` with the same arguments, except inside
    :func:`observers_asleep` or a ``torch.func`` transform, where it does nothing and returns ``None``.

    An error of ``hook`` costs what it records, not the step: the call returns ``None`` and the error is warned
    about once per kind of hook, module and error.
    """

    asleep = 0
    """How many :func:`observers_asleep` blocks are open (one switch for the whole process)."""

    failed: set[tuple[str, str, str]] = set()
    """The kinds of hook, module and error already warned about in this process."""

    transformed: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    """The modules whose calls were passed over because they ran inside a ``torch.func`` transform."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any) -> Any:
        if Observer.asleep:
            return None
        if in_transform():
            Observer.transformed.add(args[0])
            return None
        try:
            return self.hook(*args)
        except Exception as error:  # a bug of ours, or a tensor it cannot read: the user's run goes on
            _warn_failed(self.hook, args[0], error)
            return None


def _warn_failed(hook: Callable[..., Any], module: nn.Module, error: Exception) -> None:
    kind = getattr(hook, "__qualname__", type(hook).__qualname__)
    key = (kind, type(module).__name__, type(error).__name__)
    if key not in Observer.failed:
        Observer.failed.add(key)
        warnings.warn(
            f"lightning_hooks could not record a call of a `{type(module).__name__}` module "
            f"({type(error).__name__}: {error}); what it would have logged for such modules is missing, and training "
            f"goes on. If its output is an ordinary tensor, this is a bug in lightning_hooks: please report it with "
            f"this message.",
            RuntimeWarning,
            stacklevel=2,
        )


@contextmanager
def observers_asleep() -> Iterator[None]:
    """Every :class:`Observer` does nothing for the duration (a replayed step that must not be recorded twice).

    Example::

        >>> import torch
        >>> layer, calls = torch.nn.Linear(2, 2), []
        >>> with HookHandles() as handles:
        ...     handles.add_forward_hooks([(layer, lambda m, i, o: calls.append("seen"))])
        ...     with observers_asleep():
        ...         _ = layer(torch.ones(1, 2))
        ...     _ = layer(torch.ones(1, 2))
        >>> calls
        ['seen']
    """
    Observer.asleep += 1
    try:
        yield
    finally:
        Observer.asleep -= 1


Hook = TypeVar("Hook")


def made_once(
    made: dict[str, Hook], modules: Sequence[tuple[str, nn.Module]], make: Callable[[str, nn.Module], Hook]
) -> list[tuple[nn.Module, Hook]]:
    """``(module, hook)`` for each named module, the hook made by ``make(name, module)`` the first time its name
    comes and kept in ``made``, so that a recorder attaches the same hook objects at every recorded step."""
    for name, module in modules:
        if name not in made:
            made[name] = make(name, module)
    return [(module, made[name]) for name, module in modules]
