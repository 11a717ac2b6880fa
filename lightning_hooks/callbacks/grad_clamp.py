"""GradClamp: clamp every parameter gradient during backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks._base import (
    HookCallback,
    check_positive_float,
    loss_scaler,
    refuse_sharded,
    trainable_parameters,
)

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


def clamp_true_gradient(
    grad: torch.Tensor, value: float, scaler: torch.amp.GradScaler | None, count: _ClampCount | None = None
) -> torch.Tensor:
    """``grad`` clamped to ``[-value, value]`` in true (unscaled) units.

    Under an enabled ``GradScaler`` the gradient carries the loss scale, so the bound is
    ``value * scale`` with the scale tensor on device (no host sync), and non-finite values are
    left as they are so that the scaler still sees the overflow and skips the step.
    """
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    if scale is None:
        if count is not None and count.active:
            count.clamped.append((grad.abs() > value).sum())
            count.seen += grad.numel()
        return grad.clamp(-value, value)
    bound = (scale * value).to(grad.dtype)
    if count is not None and count.active:
        count.clamped.append((grad.abs() > bound).logical_and(torch.isfinite(grad)).sum())
        count.seen += grad.numel()
    return torch.where(torch.isfinite(grad), torch.clamp(grad, -bound, bound), grad)


class _ClampHook:
    def __init__(self, value: float, count: _ClampCount, scaler: torch.amp.GradScaler | None) -> None:
        self.value, self.count, self.scaler = value, count, scaler

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return clamp_true_gradient(grad, self.value, self.scaler, self.count)


ClampMode = Literal["backward", "accumulated"]


class GradClamp(HookCallback):
    """Clamp every trainable parameter's gradient to ``[-value, value]``.

    With ``mode="backward"`` (the default) a tensor hook (``Tensor.register_hook``) on each
    trainable parameter of the selected modules replaces the gradient that autograd is about to
    accumulate into ``.grad`` with its clamped copy, during backward. With
    ``mode="accumulated"`` no hook is registered; the accumulated ``.grad`` is clamped in place
    once per optimizer step, in ``on_before_optimizer_step``.

    Frozen parameters (``requires_grad=False``) are skipped; a parameter shared by several modules
    is clamped once. On logging steps the share of gradient elements that were clamped is logged
    as ``grad_clamp/clamped_fraction``; on other steps nothing is counted and nothing waits for
    the device.

    Which mode to pick:

    * ``"backward"`` bounds each backward pass's contribution: under gradient accumulation with
      ``k`` micro-batches a gradient can reach ``k * value``; under DDP each rank clamps its local
      gradient *before* the all-reduce averages them (so the result is the mean of clamped
      per-rank gradients, which tames a single rank's outlier batch).
    * ``"accumulated"`` clamps the gradient the optimizer will use: after accumulation, after the
      DDP all-reduce, after AMP unscaling. It equals ``Trainer(gradient_clip_val=value,
      gradient_clip_algorithm="value")`` in every setup. It also works where parameter tensor hooks
      do not fire (sharded parameters).

    In both modes the bound applies to the *true* gradient. Under an enabled ``GradScaler``
    (fp16 mixed precision), the backward hook sees gradients multiplied by the loss scale, so it
    clamps to ``value * scale`` using the scale tensor on the device (no host sync) and leaves
    ``inf``/``NaN`` untouched, so that the scaler still detects an overflow, skips that step and
    lowers its scale. With one process, fp32 or a ``GradScaler``, and no gradient accumulation,
    both modes give exactly the weights of Lightning's value clipping.

    Args:
        value: The bound, a positive finite number.
        mode: ``"backward"`` (tensor hooks, per backward pass) or ``"accumulated"`` (once per
            optimizer step, on the accumulated gradient).
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
        mode: ClampMode = "backward",
        log_every_n_steps: int | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
    ) -> None:
        owner = type(self).__name__
        self.value = check_positive_float(owner, "value", value)
        if mode not in ("backward", "accumulated"):
            raise ValueError(f"`{owner}` got `mode={mode!r}`; `mode` must be 'backward' or 'accumulated'.")
        self.mode = mode
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        self._count = _ClampCount()
        self._step: int | None = None
        self._params: list[nn.Parameter] = []
        self._scaler: torch.amp.GradScaler | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.mode == "backward":
            refuse_sharded(trainer.strategy, f"`{type(self).__name__}(mode='backward')`", "use `mode='accumulated'`")

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._count = _ClampCount()
        self._step = None
        self._scaler = loss_scaler(trainer)
        self._params = [param for _, param in trainable_parameters(modules)]
        if self.mode == "backward":
            for param in self._params:
                self._handles.add(param.register_hook(_ClampHook(self.value, self._count, self._scaler)))

    @override
    def _detach(self) -> None:
        super()._detach()
        self._count.reset()
        self._step = None
        self._params = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None and self.is_logging_step(trainer):
            self._step = trainer.global_step
            self._count.active = True

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.mode != "accumulated":
            return
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        with torch.no_grad():
            for param in self._params:
                if param.grad is not None and id(param) in in_optimizer:
                    # Gradients are unscaled by now: the bound is `value` itself.
                    param.grad.copy_(clamp_true_gradient(param.grad, self.value, None, self._count))

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
