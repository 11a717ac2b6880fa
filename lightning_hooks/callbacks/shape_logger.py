"""ShapeLogger: the per-layer input and output shapes of a training step."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback, note_recorded, tensor_parallel_mesh
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.nested import Signature, format_signature, leaf_shapes, signature
from lightning_hooks.core.select import type_label
from lightning_hooks.recorders.shapes import ShapeRecorder, format_table, parameter_count, shape_table
from lightning_hooks.sinks.sink import echo

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShapeLogger"]

TAG = "shapes/train"


class ShapeLogger(HookCallback):
    """Print and log a table of every selected module's input and output shapes.

    Forward hooks on each selected module record one row per call, in the order calls start. On the
    first training step the table (qualified name, class, input and output shapes, parameter count
    including children) is printed on rank zero and logged under ``shapes/train`` at ``global_step``.
    Later, shapes are recorded again when the batch's shapes change and every ``log_every_n_steps``
    optimizer steps; a table unlike every one logged in this fit is printed and logged. Only training
    steps are recorded, not activation checkpointing's recompute. Inside a ``torch.compile``'d region
    the hooks are compiled into the graph of the steps that record, so a recorded step runs compiled
    (no eager step, whose memory would be the eager model's).

    Args:
        log_every_n_steps: How often, in optimizer steps, shapes are re-checked even when the
            batch's shapes did not change. ``None`` uses the Trainer's ``log_every_n_steps``.
        include: Glob patterns over qualified module names to hook (``""`` is the
            LightningModule itself); ``None`` hooks every module.
        exclude: Glob patterns of modules not to hook.
        types: Class names of modules to hook, matched along each module's class hierarchy
            (``"Conv2d"``, ``"_ConvNd"``).
        max_depth: Hook modules at most this many levels below the LightningModule.
        collapse_repeats: Show a run of three or more consecutive sibling blocks with the same calls, classes,
            parameter counts and shapes once, named with the range of indices and followed by the number of
            blocks: ``encoder.layer.0–23  ×24``. ``False`` shows a row for every module call.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import ShapeLogger
        >>> trainer = Trainer(callbacks=[ShapeLogger(types=["Linear", "Conv2d"])], logger=False)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
        collapse_repeats: bool = True,
    ) -> None:
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        self.collapse_repeats = _validate.boolean("ShapeLogger", "collapse_repeats", collapse_repeats)
        self._recorder = ShapeRecorder()
        self._logged: set[str] = set()
        self._last_batch: tuple[torch.Size, ...] | None = None
        self._batch: Signature = ()
        self._printed_batch: Signature | None = None
        """The batch of the last table printed in this fit."""
        self._params: dict[str, int] = {}
        self._tensor_parallel = False

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._recorder = ShapeRecorder()
        self._params = {name: parameter_count(module) for name, module in modules}
        self._last_batch = None
        self._printed_batch = None
        self._tensor_parallel = tensor_parallel_mesh(trainer) is not None
        self._eager_modules, compiled = self._regions.enter(pl_module, modules)
        self._recorder.attach_switched(compiled, self._handles, self._params)

    @override
    def _detach(self) -> None:
        super()._detach()
        self._recorder.active = False
        self._recorder.clear()
        self._logged = set()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"logged_tables": sorted(self._logged)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._logged = set(state_dict.get("logged_tables", []))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        batch_shapes = leaf_shapes(batch)
        changed = batch_shapes != self._last_batch
        self._last_batch = batch_shapes
        periodic = self.due_step(trainer) is not None
        due = bool(self._modules) and (not self._logged or changed or periodic)
        if due and self.gate.begin(trainer.global_step, due=True):
            self._batch = signature(batch)
            self._recorder.clear()
            self._recorder.active = True
            self._recorder.attach(self._eager_modules, self._step_handles, self._params, prepend=self._tensor_parallel)
            self._regions.vote(self, True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        self._step_handles.remove()
        if not self.gate.is_open:
            return
        self._regions.vote(self, False)
        step = self.gate.end(trainer.global_step, force=True)  # one batch is recorded, not a whole step
        assert step is not None
        recorder.active = False
        note_recorded(trainer, "ShapeLogger", self._modules, {row.name for row in recorder.rows})
        table = recorder.table()
        digest = hashlib.sha1(repr(table).encode()).hexdigest()[:16]
        if table and digest not in self._logged:
            self._logged.add(digest)
            header = f"{type_label(pl_module)} · step {step} · batch {format_signature(self._batch)}"
            if self._printed_batch is not None:  # say why there is another table
                before = format_signature(self._printed_batch)
                changed = self._batch != self._printed_batch
                header += f" (batch shapes changed from {before})" if changed else " (shapes inside the model changed)"
            self._printed_batch = self._batch
            echo(f"ShapeLogger: {header}\n{format_table(recorder.rows, self.collapse_repeats)}", trainer)
            self._sink.table(trainer, TAG, *shape_table(recorder.rows, self.collapse_repeats), step, caption=header)
        recorder.clear()
