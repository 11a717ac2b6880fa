"""GradClamp: clamp every parameter gradient during backward."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback, loss_scaler, refuse_sharded, tensor_parallel_mesh
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.select import trainable_parameters
from lightning_hooks.core.shards import is_sharded
from lightning_hooks.recorders.clamp import GradClamper

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = ["GradClamp"]

TAG = "grad_clamp/clamped_fraction"

ClampMode = Literal["backward", "accumulated"]


class GradClamp(HookCallback):
    """Clamp every trainable parameter's gradient to ``[-value, value]``.

    With ``mode="backward"`` (the default) each backward pass's gradient of each trainable parameter
    of the selected modules is clamped before it is accumulated into ``.grad`` (on a single device with
    automatic optimization, no ``GradScaler`` and no accumulation, all in place as the pass ends). With
    ``mode="accumulated"`` the accumulated ``.grad`` is clamped in place in ``on_before_optimizer_step``.

    Frozen parameters are skipped; a shared parameter is clamped once. The bound applies to the *true*
    gradient: under an enabled ``GradScaler`` the backward hook clamps to ``value * scale`` and leaves
    ``inf``/``NaN`` alone, so that the scaler still skips an overflowing step. On logging steps the share of
    gradient elements that were clamped is logged as ``grad_clamp/clamped_fraction`` (every rank's, under
    DDP and FSDP2). Which mode to pick, and how each behaves under DDP, FSDP2 and AMP: docs/grad-clamp.md.

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
        self.value = _validate.positive_float(owner, "value", value)
        self.mode: ClampMode = _validate.choice(owner, "mode", mode, ("backward", "accumulated"))
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        self._clamper = GradClamper(self.value)
        self._params: list[nn.Parameter] = []
        self._sharded = False  # some parameter is sharded (FSDP2): the clamped count is summed over processes
        self._per_backward = False  # each backward pass gets its clamp in `on_before_backward`, as it ends

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_params": []}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self.mode == "backward":
            refuse_sharded(trainer.strategy, f"`{type(self).__name__}(mode='backward')`", "use `mode='accumulated'`")

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._clamper = GradClamper(self.value, loss_scaler(trainer))
        if (mesh := tensor_parallel_mesh(trainer)) is not None:
            self._clamper.counts_plain = mesh.get_local_rank() == 0
        self._params = [param for _, param in trainable_parameters(modules)]
        self._sharded = any(is_sharded(param) for param in self._params)
        if self.mode == "backward" and any(isinstance(m, FSDPModule) for m in pl_module.modules()):
            self._clamper.attach_unsharded(modules, self._params, self._handles, self._step_handles)
        elif self.mode == "backward":
            self._per_backward = (
                # Not under DDP, even in one process: it copies its reduced buckets into `.grad` as the pass ends.
                isinstance(trainer.strategy, SingleDeviceStrategy)
                and self._clamper.scaler is None
                and trainer.accumulate_grad_batches == 1
                and pl_module.automatic_optimization
                and type(pl_module).backward is LightningModule.backward  # the loss given is the one backpropagated
            )
            if not self._per_backward:
                self._clamper.attach(self._params, self._handles)

    @override
    def _detach(self) -> None:
        super()._detach()
        self._clamper.count.reset()
        self._clamper.unsharded.clear()
        self._params = []
        self._per_backward = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.gate.is_open:
            step = self.due_step(trainer)
            self._clamper.count.active = step is not None and self.gate.begin(step, due=True)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._per_backward:
            self._clamper.attach_backward(loss, self._params, self._step_handles)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._per_backward:
            self._step_handles.remove()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.mode == "accumulated":
            self._clamper.clamp_accumulated(self._params, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_handles.remove()  # the clamps on FSDP2's unsharded parameters, hooked again by the next forward
        self._clamper.unsharded.clear()
        if not self.gate.is_open:  # a quiet batch: nothing was counted
            return
        step = self.gate.end(trainer.global_step)  # once the optimizer has stepped: every micro-batch counted
        if step is not None:
            fraction = self._clamper.count.fraction(partial(_summed, trainer.strategy) if self._sharded else None)
            if fraction is not None:
                self._sink.scalars(trainer, {TAG: fraction}, step)


def _summed(strategy: Strategy, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over every process, on the strategy's device (one all-reduce)."""
    return strategy.reduce(tensor.to(strategy.root_device), reduce_op="sum")
