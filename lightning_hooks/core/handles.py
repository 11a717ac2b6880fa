"""The single owner of the ``RemovableHandle`` objects a callback creates."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle


class HookHandles:
    """Owns hook handles so that one call removes all of them.

    ``remove()`` is idempotent and leaves the owner empty, so it can be called from every exit
    path of a run (success, exception, teardown) without bookkeeping. Used as a context manager
    it removes everything on exit, whatever happened inside.

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
        self, hooks: Sequence[tuple[nn.Module, Callable[..., Any]]], always_call: bool = False
    ) -> None:
        """Register each ``(module, hook)`` as ``module.register_forward_hook(hook, always_call=...)`` would, under
        one handle.

        ``register_forward_hook`` makes a ``RemovableHandle`` per hook: about 22,400 instructions to
        register and remove one (callgrind, 300 ``Tanh`` modules), 15 M for the 684 hooks of a 24-layer
        encoder's logging step. Here one handle's id keys the hook in every module's forward-hook dict,
        the dict torch's own registration writes to, and the handle's "extra" dicts, which its
        ``remove()`` clears of that id too, are the other modules' dicts: 7,100 a module.
        The hooks run, in order, exactly as registered ones. A module that registers its hooks its
        own way (a class that overrides ``register_forward_hook``) and a module given twice get
        theirs from ``register_forward_hook``.
        """
        flags = "_forward_hooks_always_called" if always_call else None
        self._add_each(hooks, "register_forward_hook", "_forward_hooks", flags, {"always_call": always_call})

    def add_forward_pre_hooks(
        self, hooks: Sequence[tuple[nn.Module, Callable[..., Any]]], with_kwargs: bool = False
    ) -> None:
        """:meth:`add_forward_hooks` for forward pre-hooks: as ``module.register_forward_pre_hook(hook,
        with_kwargs=...)`` would register each, under one handle."""
        flags = "_forward_pre_hooks_with_kwargs" if with_kwargs else None
        self._add_each(hooks, "register_forward_pre_hook", "_forward_pre_hooks", flags, {"with_kwargs": with_kwargs})

    def _add_each(
        self,
        hooks: Sequence[tuple[nn.Module, Callable[..., Any]]],
        method: str,
        hook_dict: str,
        flag_dict: str | None,
        options: dict[str, bool],
    ) -> None:
        """Write each hook into its module's ``hook_dict`` (and the id into ``flag_dict``, the dict in which torch
        marks a hook's option) under one handle, or register it with ``method`` where that cannot be done."""
        batched: list[tuple[OrderedDict[int, Any], Callable[..., Any], dict[int, bool] | None]] = []
        seen: set[int] = set()
        for module, hook in hooks:
            found = getattr(module, hook_dict, None)
            flags = None if flag_dict is None else getattr(module, flag_dict, None)
            plain = getattr(type(module), method) is getattr(nn.Module, method)
            if (
                plain
                and isinstance(found, OrderedDict)
                and id(found) not in seen
                and (flag_dict is None or flags is not None)
            ):
                seen.add(id(found))
                batched.append((found, hook, flags))
            else:  # registered now, after the hooks batched so far, to keep the order
                self._add_batched(batched)
                batched, seen = [], set()
                self.add(getattr(module, method)(hook, **options))
        self._add_batched(batched)

    def _add_batched(
        self, batched: list[tuple[OrderedDict[int, Any], Callable[..., Any], dict[int, bool] | None]]
    ) -> None:
        if batched:
            extra = [d for d, _, _ in batched[1:]] + [f for _, _, f in batched if f is not None]
            handle = self.add(RemovableHandle(batched[0][0], extra_dict=extra))
            for found, hook, flags in batched:
                found[handle.id] = hook
                if flags is not None:
                    flags[handle.id] = True

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
        # Handles point at hook dicts of live modules through weak references; a copy of the
        # owner that travels to another process (ddp_spawn, checkpoint) must not carry them.
        return {"_handles": []}


Hook = TypeVar("Hook")


def made_once(
    made: dict[str, Hook], modules: Sequence[tuple[str, nn.Module]], make: Callable[[str, nn.Module], Hook]
) -> list[tuple[nn.Module, Hook]]:
    """``(module, hook)`` for each named module, the hook made by ``make(name, module)`` the first time a name comes
    and kept in ``made``: a recorder attaches the same hook objects at every logging step (making them cost about
    3,000 instructions a module)."""
    for name, module in modules:
        if name not in made:
            made[name] = make(name, module)
    return [(module, made[name]) for name, module in modules]
