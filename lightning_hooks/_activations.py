"""Recording statistics of module outputs with forward hooks (pure torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hooks._autograd import in_backward
from lightning_hooks._compiled import Pending, Region, Switched
from lightning_hooks._handles import HookHandles
from lightning_hooks._nested import named_tensors
from lightning_hooks._stats import OutputKeys, StatBatch


class ActivationRecorder:
    """Observe every floating-point tensor each hooked module returns, into ``batch`` under ``("act", <layer>)``.

    Nested outputs are observed per tensor (``<layer>.out.<path>``); a module called several times
    pools its calls under one key. ``fired`` (a set of the caller's, or a new one) collects the
    names of the modules whose hook ran. The forward that activation checkpointing re-runs in
    backward is not counted.

    Example::

        >>> import torch
        >>> from lightning_hooks._stats import StatBatch, derive
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        >>> batch = StatBatch()
        >>> batch.start()
        >>> with HookHandles() as handles:
        ...     ActivationRecorder(batch).attach([("1", model[1])], handles)
        ...     _ = model(torch.ones(2, 4))
        >>> sorted(batch.fetch().states)
        [('act', '1')]
    """

    def __init__(self, batch: StatBatch, histograms: bool = False, fired: set[str] | None = None) -> None:
        self.batch, self.histograms = batch, histograms
        self.fired = set() if fired is None else fired
        self.keys = OutputKeys("act")

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        for name, module in modules:
            handles.add(module.register_forward_hook(_ActivationHook(self, name, self.batch)))

    def attach_switched(
        self, modules: Sequence[tuple[str, nn.Module, Region]], handles: HookHandles, pending: Pending
    ) -> None:
        """Hook modules inside compiled regions for a whole fit: each hook runs while its region's switch
        is on and leaves its states in ``pending`` (see :mod:`lightning_hooks._compiled`)."""
        for name, module, region in modules:
            region.settles(pending)
            handles.add(module.register_forward_hook(Switched(region.switch, _ActivationHook(self, name, pending))))


class _ActivationHook:
    def __init__(self, recorder: ActivationRecorder, name: str, into: StatBatch | Pending) -> None:
        self.recorder, self.name, self.into = recorder, name, into

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if in_backward():  # activation checkpointing re-running forward
            return
        recorder, into = self.recorder, self.into
        if isinstance(into, Pending):  # inside compiled code: see Pending
            into.fired.append(self.name)
        else:
            recorder.fired.add(self.name)
        for path, tensor in named_tensors(output):
            if tensor.is_floating_point():
                into.add(recorder.keys.key(self.name, path), tensor, recorder.histograms)
