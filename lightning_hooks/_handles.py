"""The single owner of the ``RemovableHandle`` objects a callback creates."""

from __future__ import annotations

from types import TracebackType
from typing import Any

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
