"""Replaying a training step that went non-finite, with a :class:`NonFiniteRecorder` attached (pure torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.handles import HookHandles, observers_asleep
from lightning_hooks.diagnose.finding import Finding, with_parameters
from lightning_hooks.recorders.finite import NonFiniteRecorder, grad_readings, parameter_readings

__all__ = ["MicroBatch", "RngState", "replay", "training_flags"]


@dataclass(frozen=True)
class RngState:
    """The states of the CPU generator and of ``device``'s, when it is an accelerator.

    Example::

        >>> state = RngState.capture(torch.device("cpu"))
        >>> a = torch.rand(2)
        >>> state.restore()
        >>> bool(torch.equal(a, torch.rand(2)))
        True
    """

    cpu: torch.Tensor
    device: torch.device | None = None
    accelerator: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type == "cpu":
            return cls(torch.get_rng_state())
        return cls(torch.get_rng_state(), device, torch.get_device_module(device).get_rng_state(device))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.accelerator is not None:
            torch.get_device_module(self.device).set_rng_state(self.accelerator, self.device)


@dataclass
class MicroBatch:
    """What replaying one micro-batch of a step needs (the batch by reference, never a copy), and its detached loss."""

    batch: Any
    batch_idx: int
    rng: RngState
    training: tuple[bool, ...]
    loss: torch.Tensor | None = None


def training_flags(modules: Sequence[nn.Module]) -> tuple[bool, ...]:
    """The train/eval flag of each module."""
    return tuple(m.training for m in modules)


def set_training_flags(modules: Sequence[nn.Module], flags: Sequence[bool]) -> None:
    for module, flag in zip(modules, flags, strict=True):
        module.training = flag


def replay(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Module]],
    micro_batches: Sequence[MicroBatch],
    run: Callable[[MicroBatch], torch.Tensor | None],
    device: torch.device,
    backward: bool = True,
    parameters: Sequence[tuple[str, torch.Tensor]] = (),
) -> Finding | None:
    """Run each micro-batch again (``run`` returns its loss) with a recorder on ``modules``; what it found.

    Each micro-batch starts from its own generator and train/eval states (of ``model.modules()``); with
    ``backward``, its loss is differentiated with respect to the recorded activations (and the named
    ``parameters``, whose non-finite gradients, summed over the micro-batches, the finding then lists) only, so no
    parameter's ``.grad`` changes. The other recorders of this package sleep meanwhile. Afterwards the generators,
    flags and buffers of ``model`` are as they were, and no hook is left.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        >>> start = RngState.capture(torch.device("cpu")), training_flags(list(model.modules()))
        >>> batch = MicroBatch(torch.ones(1, 2), 0, *start)
        >>> print(replay(model, [("0", model[0])], [batch], lambda mb: model(mb.batch).sum(), torch.device("cpu")))
        None
    """
    every = list(model.modules())
    rng, flags = RngState.capture(device), training_flags(every)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    recorder = NonFiniteRecorder(check_backward=backward)
    named_weights = [(name, p) for name, p in parameters if p.requires_grad] if backward else []
    weights = [p for _, p in named_weights]
    grads: dict[int, torch.Tensor] = {}
    try:
        with observers_asleep(), HookHandles() as handles, torch.enable_grad():
            recorder.attach(modules, handles)
            recorder.active = True
            for micro in micro_batches:
                micro.rng.restore()
                set_training_flags(every, micro.training)
                recorder.batch_idx, recorder.keep = micro.batch_idx, []
                loss = run(micro)
                if isinstance(loss, torch.Tensor):
                    recorder.record_loss(loss)
                    inputs = [*recorder.keep, *weights]
                    if backward and loss.requires_grad and inputs:
                        found = torch.autograd.grad(loss.float().sum(), inputs, allow_unused=True)
                        for i, g in enumerate(found[len(recorder.keep) :]):
                            if g is not None:
                                grads[i] = g if i not in grads else grads[i] + g
                recorder.keep = None  # the activations go with the micro-batch
        named = [(named_weights[i][0], g) for i, g in sorted(grads.items())]
        norms = torch.stack(grad_readings(named)).tolist() if named else []
        return with_parameters(recorder.find()[0], parameter_readings(named, norms))
    finally:
        recorder.active, recorder.keep = False, None
        rng.restore()
        set_training_flags(every, flags)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
