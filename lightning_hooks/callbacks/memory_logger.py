"""MemoryLogger: where the memory of one training step goes, module by module, and what would lower its peak."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback, note_recorded
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.compiled import has_compiled
from lightning_hooks.core.select import is_compile_wrapper, label, type_label
from lightning_hooks.recorders.memory import MemoryRecorder, MemoryRow
from lightning_hooks.recorders.memory_report import advice, format_memory_table, memory_table
from lightning_hooks.sinks.sink import echo

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryLogger"]

TAG = "memory/train"
SNAPSHOT = "memory_snapshot.pickle"
HISTORY_ENTRIES = 100_000
"""How many allocation events the CUDA memory history keeps for an out-of-memory snapshot."""


class MemoryLogger(HookCallback):
    """Print and log where the memory of one training step goes, module by module, and what would lower its peak.

    Optimizer step ``at_step`` (its first micro-batch) is recorded with torch's ``MemTracker``
    (``FSDPMemTracker`` under ``ModelParallelStrategy``). After it, :attr:`rows` holds a ``MemoryRow`` per
    selected module with the bytes of its parameters, gradients, optimizer state, activations kept for backward,
    backward temporaries and the step's peak while it ran, each including its children; :attr:`peak` and
    :attr:`peak_at` say how high the step went and where, and :attr:`summary` what would lower the peak most
    (activation checkpointing of repeated blocks, or a sharded or 8-bit optimizer). On rank zero the table is
    printed and logged under ``memory/train`` with the scalars ``memory/peak_bytes``, ``memory/activations_bytes``
    and ``memory/optimizer_state_bytes``; under DDP and FSDP2 every rank records its own and the summary names the
    largest peak over ranks. No hook is attached on any other step. A failure of the tracker warns once and
    training goes on.

    Args:
        at_step: The optimizer step to record; the default, 1, is the first at which the optimizer's state exists.
        include: Glob patterns over qualified module names to show (``""`` is the LightningModule itself);
            ``None`` shows every module.
        exclude: Glob patterns of modules not to show.
        types: Class names of modules to show, matched along each module's class hierarchy.
        max_depth: Show modules at most this many levels below the LightningModule.
        collapse_repeats: Show a run of three or more consecutive sibling blocks with the same parameters,
            activations and optimizer state once, as the shape table does: ``layers.0–23  ×24``.
        snapshot_on_oom: On CUDA, record the allocator's history from the start of fit and, if the fit dies of
            ``torch.OutOfMemoryError``, write it to ``memory_snapshot.pickle`` next to the logs (open it at
            https://pytorch.org/memory_viz). Off by default: the history slows every step (see the
            documentation's Performance page); turn it on for the run you expect to fail. Does nothing on CPU.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import MemoryLogger
        >>> trainer = Trainer(callbacks=[MemoryLogger(at_step=1, max_depth=2)], logger=False)
    """

    def __init__(
        self,
        at_step: int = 1,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
        collapse_repeats: bool = True,
        snapshot_on_oom: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps=None, include=include, exclude=exclude, types=types, max_depth=max_depth)
        self.at_step = _validate.non_negative_int("MemoryLogger", "at_step", at_step)
        self.collapse_repeats = _validate.boolean("MemoryLogger", "collapse_repeats", collapse_repeats)
        self.snapshot_on_oom = _validate.boolean("MemoryLogger", "snapshot_on_oom", snapshot_on_oom)
        self.rows: list[MemoryRow] = []
        self.peak = 0
        self.peak_at = ""
        self.summary = ""
        self._recorder: MemoryRecorder | None = None
        self._history = False
        self._warned = False
        self._warned_compiled = False

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_recorder": None}  # a recording in progress stays with the original

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self.rows, self.peak, self.peak_at, self.summary = [], 0, "", ""
        wrapped = [label(n) for n, m in pl_module.named_modules() if is_compile_wrapper(m) and has_compiled(m, modules)]
        if wrapped and not self._warned_compiled:
            self._warned_compiled = True
            rank_zero_warn(
                f"`MemoryLogger`: torch's memory tracker does not follow the modules inside `torch.compile(module)` "
                f"({', '.join(f'`{n}`' for n in wrapped[:3])}), so their rows show no peak or temporaries and the "
                f"step's peak is placed outside them. Compiling the LightningModule instead, "
                f"`trainer.fit(torch.compile(model))`, keeps every column."
            )
        if self.snapshot_on_oom and trainer.strategy.root_device.type == "cuda":
            # Python stacks of allocations only; what recording costs a step: docs/performance.md, "On a GPU".
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=HISTORY_ENTRIES)
            self._history = True

    @override
    def _detach(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._history:
            self._history = False
            torch.cuda.memory._record_memory_history(enabled=None)
        super()._detach()

    def _optimizers(self, trainer: pl.Trainer) -> list[torch.optim.Optimizer]:
        return [getattr(o, "optimizer", o) for o in trainer.optimizers]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.at_step or self.rows or not self.gate.begin(trainer.global_step, due=True):
            return
        recorder = self._recorder = MemoryRecorder(pl_module, self._modules, self._step_handles)
        optimizers = self._optimizers(trainer)
        try:
            recorder.start(optimizers, batch)
            for optimizer in optimizers:
                self._step_handles.add(optimizer.register_step_pre_hook(_Restart(recorder, optimizers)))
        except Exception as error:
            self._give_up(error)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._recorder is not None:
            self._recorder.optimizer_begins()

    def _give_up(self, error: BaseException) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                f"`MemoryLogger` could not record step {self.at_step}: torch's memory tracker failed with "
                f"{type(error).__name__}: {error}. Training goes on without a memory table."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None or not self.gate.is_open:
            return
        step = self.gate.end(trainer.global_step, force=True)
        assert step is not None
        self._recorder = None
        try:
            memory = recorder.finish(self._optimizers(trainer))
        except Exception as error:
            self._give_up(error)
            return
        self.rows, self.peak, self.peak_at = memory.rows, memory.peak, memory.peak_at
        peaks = trainer.strategy.all_gather(torch.tensor(float(memory.peak))) if trainer.world_size > 1 else None
        ranks = [int(p) for p in peaks.reshape(-1).tolist()] if peaks is not None else [memory.peak]
        self.summary = advice(memory, ranks)
        note_recorded(trainer, "MemoryLogger", self._modules, set(memory.inputs))  # each module whose forward ran
        header = f"{type_label(pl_module)} · step {step} · {self.summary}"
        echo(f"MemoryLogger: {header}\n{format_memory_table(memory.rows, self.collapse_repeats)}", trainer)
        with self._sink.gathered(trainer):
            self._sink.table(trainer, TAG, *memory_table(memory.rows, self.collapse_repeats), step, caption=header)
            scalars = {
                "memory/peak_bytes": float(memory.peak),
                "memory/activations_bytes": float(memory.activations),
                "memory/optimizer_state_bytes": float(memory.optimizer_state),
            }
            self._sink.scalars(trainer, scalars, step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._history and isinstance(exception, torch.OutOfMemoryError):
            self._write_snapshot(trainer)
        super().on_exception(trainer, pl_module, exception)

    def _write_snapshot(self, trainer: pl.Trainer) -> None:
        # Any rank can run out: each writes its own history, and says so itself (rank zero may never hear of it).
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        path = folder / (SNAPSHOT if rank == 0 else SNAPSHOT.replace(".pickle", f"_rank{rank}.pickle"))
        torch.cuda.memory._dump_snapshot(str(path))
        last = f"\nThe last table recorded (step {self.at_step}):\n{self.summary}\n" if self.rows else ""
        table = format_memory_table(self.rows, self.collapse_repeats) if self.rows else ""
        where = f"rank {rank}" if trainer.world_size > 1 else "the fit"
        print(
            f"MemoryLogger: {where} ran out of GPU memory; the allocator's history is in {path} (drag it onto "
            f"https://pytorch.org/memory_viz to see every allocation and who made it).{last}{table}",
            file=sys.stderr,
            flush=True,
        )


class _Restart:
    """An optimizer's step pre-hook: see :meth:`MemoryRecorder.restart_unless_forward_ran`."""

    def __init__(self, recorder: MemoryRecorder, optimizers: list[torch.optim.Optimizer]) -> None:
        self.recorder, self.optimizers = recorder, optimizers

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.recorder.restart_unless_forward_ran(self.optimizers)
