"""Recording statistics of module outputs with forward hooks (pure torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hooks._autograd import in_backward
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

    def __init__(
        self, batch: StatBatch, histograms: bool = False, fired: set[str] | None = None, units: bool = False
    ) -> None:
        self.batch, self.histograms, self.units = batch, histograms, units
        self.fired = set() if fired is None else fired
        self.keys = OutputKeys("act")
        self.unit_keys = OutputKeys("units")

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        for name, module in modules:
            handles.add(module.register_forward_hook(_ActivationHook(self, name, channels_first(module))))


class _ActivationHook:
    def __init__(self, recorder: ActivationRecorder, name: str, channels_first: bool = False) -> None:
        self.recorder, self.name, self.channels_first = recorder, name, channels_first

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if in_backward():  # activation checkpointing re-running forward
            return
        recorder = self.recorder
        recorder.fired.add(self.name)
        for path, tensor in named_tensors(output):
            if tensor.is_floating_point():
                recorder.batch.add(recorder.keys.key(self.name, path), tensor, recorder.histograms)
                if recorder.units and tensor.dim() >= 2:
                    counts = fired_per_unit(tensor, self.channels_first)
                    recorder.batch.add_vector(recorder.unit_keys.key(self.name, path), counts)


_CHANNELS_FIRST = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def channels_first(module: nn.Module) -> bool:
    """Whether the module's 3-d outputs are ``(batch, channels, length)`` (1-d convolutions and their norms)
    rather than ``(batch, sequence, features)``."""
    return isinstance(module, _CHANNELS_FIRST) or type(module).__name__.endswith(("Pool1d", "Pool2d", "Pool3d"))


def unit_dim(t: torch.Tensor, channels_first: bool = False) -> int:
    """The dimension of ``t`` that holds a layer's units: channels of an image or volume map (``(N, C, H, W)``,
    ``(N, C, D, H, W)``) and of a 1-d convolution's output, features of anything else (``(N, F)``, ``(N, T, F)``)."""
    return 1 if t.dim() in (4, 5) or (t.dim() == 3 and channels_first) else t.dim() - 1


def fired_per_unit(t: torch.Tensor, channels_first: bool = False) -> torch.Tensor:
    """For each unit of ``t`` (see :func:`unit_dim`), how many of its values are non-zero, on ``t``'s device.

    Example::

        >>> fired_per_unit(torch.tensor([[0.0, 1.0, 0.0], [0.0, 2.0, 3.0]]))
        tensor([0., 2., 1.])
    """
    x = t.detach()
    dim = unit_dim(x, channels_first)
    others = [d for d in range(x.dim()) if d != dim]
    return x.ne(0).sum(others, dtype=torch.float32)
