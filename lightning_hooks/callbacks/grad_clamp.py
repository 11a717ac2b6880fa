"""GradClamp: clamp every parameter gradient during backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback, check_positive_float

if TYPE_CHECKING:
    import lightning.pytorch as pl

TAG = "grad_clamp/clamped_fraction"


class _ClampCount:
    """On logging steps, how many gradient elements were clamped (counted on device)."""

    def __init__(self) -> None:
        self.active = False
        self.clamped: list[torch.Tensor] = []
        self.seen = 0

    def reset(self) -> None:
        self.active, self.clamped, self.seen = False, [], 0


class _ClampHook:
    def __init__(self, value: float, count: _ClampCount) -> None:
        self.value, self.count = value, count

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.count.active:
            self.count.clamped.append((grad.abs() > self.value).sum())
            self.count.seen += grad.numel()
        return grad.clamp(-self.value, self.value)


class GradClamp(HookCallback):
    """Clamp every trainable parameter's gradient to ``[-value, value]`` during backward.

    A tensor hook (``Tensor.register_hook``) on each trainable parameter of the selected modules
    replaces the gradient autograd is about to accumulate into ``.grad`` with its clamped copy.
    Frozen parameters (``requires_grad=False``) are skipped; a parameter shared by several modules
    is hooked once. On logging steps the fraction of gradient elements that were clamped is
    logged as ``grad_clamp/clamped_fraction``; on other steps nothing is counted and nothing
    waits for the device.

    With one process, no gradient accumulation and no ``GradScaler``, the result is exactly that
    of ``Trainer(gradient_clip_val=value, gradient_clip_algorithm="value")``. Elsewhere the two differ:

    .. warning::
        * **Gradient accumulation**: the hook clamps each backward pass's gradient, so after
          ``k`` micro-batches a gradient may reach ``k * value``; Lightning clips the accumulated sum.
        * **DDP**: each rank clamps its local gradient before the all-reduce averages them;
          Lightning clips the averaged gradient.
        * **GradScaler (fp16 AMP)**: the hook sees gradients multiplied by the loss scale, so it
          bounds the true gradient by ``value / scale``; Lightning clips after unscaling.

    Args:
        value: The bound, a positive finite number.
        log_every_n_steps: How often, in optimizer steps, ``grad_clamp/clamped_fraction`` is
            logged. ``None`` uses the Trainer's ``log_every_n_steps``.
        include: Glob patterns over qualified module names whose parameters are clamped
            (``""`` is the LightningModule itself); ``None`` clamps every parameter.
        exclude: Glob patterns of modules whose own parameters are left alone.
        types: Class names of modules whose parameters are clamped, matched along the class hierarchy.
        max_depth: Clamp parameters of modules at most this many levels below the LightningModule.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import GradClamp
        >>> trainer = Trainer(callbacks=[GradClamp(0.2)], logger=False)
    """

    def __init__(
        self,
        value: float,
        log_every_n_steps: int | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
    ) -> None:
        self.value = check_positive_float(type(self).__name__, "value", value)
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        self._count = _ClampCount()
        self._step: int | None = None

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._count = _ClampCount()
        self._step = None
        seen: set[int] = set()
        for _, module in modules:
            for param in module.parameters(recurse=False):
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self._handles.add(param.register_hook(_ClampHook(self.value, self._count)))

    @override
    def _detach(self) -> None:
        super()._detach()
        self._count.reset()
        self._step = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None and self.is_logging_step(trainer):
            self._step = trainer.global_step
            self._count.active = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Emit once the optimizer has stepped, so that every micro-batch of the step is counted.
        if self._step is None or trainer.global_step == self._step:
            return
        count, step = self._count, self._step
        if count.seen:
            clamped = torch.stack(count.clamped).sum().item()  # the one host transfer of the step
            self._sink.scalars(trainer, {TAG: clamped / count.seen}, step)
        count.reset()
        self._step = None
