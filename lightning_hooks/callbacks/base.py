"""What every hook callback shares: selection, the step gate and the hook lifecycle."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.dashboard import FIGURE_PERIOD_FACTOR, Dashboard
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.compiled import Pending, Region, Regions
from lightning_hooks.core.gate import StepGate
from lightning_hooks.core.handles import HookHandles, Observer
from lightning_hooks.core.select import ModuleSelector, label
from lightning_hooks.sinks.sink import Sink
from lightning_hooks.stats.batch import Across, Fetched, StatBatch
from lightning_hooks.stats.histogram import Histogram
from lightning_hooks.stats.state import STATS

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "HookCallback",
    "StatsCallback",
    "data_parallel_size",
    "loss_scaler",
    "metrics",
    "note_recorded",
    "overflow_flags",
    "refuse_sharded",
    "report_silent_modules",
    "tensor_parallel_mesh",
]


def loss_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The ``GradScaler`` of the Trainer's precision plugin, if one is scaling the loss."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def overflow_flags(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The flags ``scaler`` set, one per device, when it unscaled ``optimizer``'s gradients this step: non-zero where
    they overflowed, and then it skips the step. Empty without a scaler, or before it unscaled them."""
    if scaler is None:
        return []
    state = scaler._per_optimizer_states.get(id(optimizer), {})  # a defaultdict: `get` adds no entry
    return list(state.get("found_inf_per_device", {}).values())


def tensor_parallel_mesh(trainer: pl.Trainer) -> DeviceMesh | None:
    """The tensor-parallel dimension of ``ModelParallelStrategy``'s mesh, if it has more than one process."""
    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy) or trainer.world_size == 1:
        return None
    mesh = strategy.device_mesh["tensor_parallel"]
    return mesh if mesh.size() > 1 else None


def data_parallel_size(trainer: pl.Trainer) -> int:
    """How many processes train on different batches (the tensor-parallel ranks of a group share theirs)."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy) and trainer.world_size > 1:
        return strategy.device_mesh["data_parallel"].size()
    return trainer.world_size


def refuse_sharded(strategy: object, what: str, fix: str) -> None:
    """Raise ``MisconfigurationException`` under FSDP1 (``FSDPStrategy``), whose flat parameters ``what`` cannot
    hook; the message suggests ``fix``."""
    if isinstance(strategy, FSDPStrategy):
        raise MisconfigurationException(
            f"{what} does not support `strategy=FSDPStrategy` (FSDP1): it flattens parameters into sharded flat "
            f"buffers, so per-parameter gradient hooks do not fire and a shard's gradient is not the parameter's. "
            f"Either {fix}, shard with `ModelParallelStrategy` (FSDP2: `fully_shard` in `configure_model`), which "
            f"{what} supports, or use DDP."
        )


class _Recorded:
    """What the callbacks of one fit recorded: the modules they selected, those whose hooks fired, who recorded."""

    def __init__(self) -> None:
        self.selected: dict[str, nn.Module] = {}
        self.fired: set[str] = set()
        self.owners: list[str] = []


_RECORDED: weakref.WeakKeyDictionary[pl.Trainer, _Recorded] = weakref.WeakKeyDictionary()


def note_recorded(trainer: pl.Trainer, owner: str, selected: list[tuple[str, nn.Module]], fired: set[str]) -> None:
    """After a recorded step: ``owner``'s selected modules and those whose hooks fired, kept until training ends."""
    recorded = _RECORDED.setdefault(trainer, _Recorded())
    for name, module in selected:
        recorded.selected.setdefault(name, module)
    recorded.fired |= fired
    if owner not in recorded.owners:
        recorded.owners.append(owner)


def report_silent_modules(trainer: pl.Trainer) -> None:
    """When training ends, once for all callbacks: warn about the selected modules with parameters that ran in no
    recorded step, nor any module inside them, nor a module that holds all their parameters.

    Excepted, because nothing the user trains goes unseen: a module without parameters (transformers' attention
    dropout, which the attention kernel applies), a container whose parent calls its children (OPT's decoder,
    called past its model; a ``Sequential`` iterated), a module whose weights another module uses (tied embeddings;
    the ``out_proj`` of an ``nn.MultiheadAttention``, whose forward hands its weights to the attention function; a
    layer whose weights its parent applies with ``F.linear``, which got gradients in the last step), a container
    without a forward, a LightningModule whose ``forward`` is Lightning's pass-through.
    """
    recorded = _RECORDED.pop(trainer, None)
    if recorded is None:
        return
    ran = {id(recorded.selected[name]) for name in recorded.fired if name in recorded.selected}
    used = {id(p) for m in recorded.selected.values() if id(m) in ran for p in m.parameters(recurse=False)}
    # Weights another module applies itself (`F.linear(x, fake_quant(self.fc.weight))`) got gradients in the last step.
    applied = {id(p) for p in trainer.lightning_module.parameters() if p.grad is not None}
    lent = {id(m.out_proj) for m in trainer.lightning_module.modules() if isinstance(m, nn.MultiheadAttention)}

    def unseen(m: nn.Module) -> bool:
        params = {id(p) for p in m.parameters()}
        return (
            type(m).forward not in (nn.Module.forward, LightningModule.forward)
            and id(m) not in lent
            and not any(id(inner) in ran for inner in m.modules())  # the module itself first: most ran
            and not params <= used
            and (m in Observer.transformed or not params <= applied)  # vmapped: its gradients were written by hand
        )

    silent = [name for name, m in recorded.selected.items() if unseen(m)]
    if not silent:
        return
    shown = ", ".join(label(n) for n in silent[:8]) + (f", ... ({len(silent) - 8} more)" if len(silent) > 8 else "")
    hints = ""
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in trainer.lightning_module.modules()):
        hints = (
            "This model contains modules compiled in place (`module.compile()`), whose compiled code lightning_hooks "
            "cannot hook into: compile with `self.layer = torch.compile(layer)` or `trainer.fit(torch.compile(model))` "
            "instead, whose regions are observed. "
        )
    transformed = sum(recorded.selected[name] in Observer.transformed for name in silent)
    if transformed:
        hints += (
            f"{transformed} of them ran inside a `torch.func` transform (`vmap`, `grad`: per-sample gradients), "
            "whose tensors hooks cannot read; a forward outside the transform is recorded. "
        )
    rank_zero_warn(
        f"lightning_hooks ({', '.join(recorded.owners)}): {len(silent)} selected module(s) never ran in any training "
        f"step they recorded in this fit, so there is nothing to show for them: {shown}. {hints}Other causes: "
        f"a module unused in `forward`, or one that runs on some steps only (an expert no token was routed to on the "
        f"recorded steps). Leave them out with `exclude=[...]` or `types=[...]` to silence this."
    )


class HookCallback(Callback):
    """Base of the callbacks: modules are selected in ``on_fit_start``, hooked by :meth:`_attach` for the fit
    (``self._handles``) or for a step (``self._step_handles``), and unhooked on every exit path."""

    def __init__(
        self,
        *,
        log_every_n_steps: int | None,
        include: list[str] | None,
        exclude: list[str] | None,
        types: list[str] | None,
        max_depth: int | None,
    ) -> None:
        owner = type(self).__name__
        _validate.positive_int(owner, "log_every_n_steps", log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.selector = ModuleSelector(include, exclude, types, max_depth, owner=owner)
        self._state_key = self._generate_state_key(
            include=self.selector.include,
            exclude=self.selector.exclude,
            types=self.selector.types,
            max_depth=self.selector.max_depth,
            log_every_n_steps=log_every_n_steps,
        )
        self._handles = HookHandles()
        self._step_handles = HookHandles()
        self._regions = Regions()
        self._modules: list[tuple[str, nn.Module]] = []
        self._eager_modules: list[tuple[str, nn.Module]] = []
        """The selected modules outside compiled regions: hooked for the steps that record."""
        self._sink = Sink(owner)
        self.gate = StepGate()
        self.batch_step = -1
        """The optimizer step :meth:`due_step` last read (the current batch's while the gate is closed)."""

    def every(self, trainer: pl.Trainer) -> int:
        """The logging period in optimizer steps."""
        return self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50

    def due_step(self, trainer: pl.Trainer) -> int | None:
        """The optimizer step if this is a logging step, else ``None``; kept in :attr:`batch_step` (for batch hooks)."""
        step = self.batch_step = trainer.global_step
        return step if step % self.every(trainer) == 0 else None

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        raise NotImplementedError

    def _remove_hooks(self) -> None:
        self._step_handles.remove()
        self._handles.remove()
        self._regions.leave()  # after the hooks: each compiled region gets its own entry point back
        self._modules, self._eager_modules = [], []

    def _detach(self) -> None:
        """End of a fit, however it ended: hooks go, per-fit state is reset."""
        self._remove_hooks()
        self.gate.reset()

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to another process or saved must not drag the model along: not the modules, nor the
        # LightningModule's `log` and `log_dict`, which Lightning binds onto every callback for the fit.
        state = {**self.__dict__, "_modules": [], "_eager_modules": [], "_regions": Regions()}
        for bound in ("log", "log_dict"):
            state.pop(bound, None)
        return state

    @property
    @override
    def state_key(self) -> str:
        # Two instances of one callback with different selections keep separate checkpoint state.
        return self._state_key

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Checkpointed state was restored before this hook: keep it, only start the hooks afresh.
        self._remove_hooks()
        _RECORDED.pop(trainer, None)  # every callback starts the fit before any step is recorded
        self._modules = self.selector.select(pl_module)
        self._attach(trainer, pl_module, self._modules)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_silent_modules(trainer)  # every step is recorded by now, by every callback
        self._sink.flush(trainer)  # a table-less logger's last row

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._sink.flush(trainer)
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()


class StatsCallback(HookCallback):
    """A callback that logs statistics on logging steps, gathered on device into a :class:`StatBatch`: ``_arm_step``
    hooks ``self._eager_modules`` for each batch of a logging step, ``_attach_compiled`` the modules inside compiled
    regions for the fit (their states wait in ``self._pending``); ``_emit`` logs once the optimizer has stepped."""

    bins = 64
    needs_logger = True
    """Whether the callback has nothing to do without a logger (``HealthMonitor`` still warns and keeps findings)."""

    def __init__(
        self,
        *,
        log_every_n_steps: int | None,
        stats: Sequence[str] | None,
        allowed_stats: Sequence[str],
        histograms: bool,
        include: list[str] | None,
        exclude: list[str] | None,
        types: list[str] | None,
        max_depth: int | None,
        figure_every_n_steps: int | None = None,
        figures: bool | None = None,
    ) -> None:
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        owner = type(self).__name__
        _validate.positive_int(
            owner, "figure_every_n_steps", figure_every_n_steps, none=f"{FIGURE_PERIOD_FACTOR} × the logging period"
        )
        self.figures = None if figures is None else _validate.boolean(owner, "figures", figures)
        if figures is False and figure_every_n_steps is not None:
            raise ValueError(
                f"`{owner}` got `figure_every_n_steps={figure_every_n_steps}` with `figures=False`; give a figure "
                f"period only when figures are drawn, or leave `figures` out."
            )
        self.figure_every_n_steps = figure_every_n_steps
        asked = figures is True or figure_every_n_steps is not None
        self._dashboard = Dashboard(owner, self._sink, figure_every_n_steps, figures is not False, asked)
        self.stats = _validate.subset(owner, "stats", stats, allowed_stats) or list(allowed_stats)
        self.histograms = _validate.boolean(owner, "histograms", histograms)
        self._batch = StatBatch(self.bins)
        self._pending = Pending()
        self._enabled = True
        self._tensor_parallel = False
        self._fired: set[str] = set()  # the selected modules whose recorder hooks ran in this fit

    def _start_step(self) -> None:
        """A logging step begins (its first micro-batch)."""

    def _arm_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _attach_compiled(self, modules: list[tuple[str, nn.Module, Region]]) -> None:
        raise NotImplementedError

    def _emit(self, trainer: pl.Trainer, step: int) -> None:
        raise NotImplementedError

    def _check_fired(self, trainer: pl.Trainer, step: int, hooked: list[tuple[str, nn.Module]] | None = None) -> None:
        """After a recorded step: which of the ``hooked`` modules (default: selected) ran; those that never did are
        named when training ends."""
        note_recorded(trainer, type(self).__name__, self._modules if hooked is None else hooked, self._fired)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._batch.clear()
        self._fired.clear()
        self._pending.clear()
        self._tensor_parallel = tensor_parallel_mesh(trainer) is not None
        self._enabled = bool(trainer.loggers) or not self.needs_logger
        self._dashboard.start(self.every(trainer))
        if not self._enabled:
            rank_zero_warn(
                f"`{type(self).__name__}` has no logger to write to (`Trainer(logger=False)`); it does nothing."
            )
            return
        self._eager_modules, compiled = self._regions.enter(pl_module, modules)
        if compiled:
            self._attach_compiled(compiled)

    @override
    def _detach(self) -> None:
        super()._detach()
        self._batch.clear()
        self._pending.clear()
        self._dashboard.reset()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled:
            return
        if not self.gate.is_open:
            step = self.due_step(trainer)
            if step is None:
                return
            self.gate.begin(step, due=True)
            self._batch.start()
            self._start_step()
        self._arm_step(trainer, pl_module)
        self._regions.vote(self, True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_handles.remove()  # and an update-ratio hook that a skipped (AMP overflow) optimizer step left
        # Also on quiet batches: another callback may have switched on a compiled region this one hooks into.
        self._pending.pour(self._batch, self._fired)
        if not self.gate.is_open:  # a quiet batch: nothing was recorded
            return
        self._regions.vote(self, False)  # validation and the next batch run the quiet graphs unless voted on again
        # Emit once the optimizer has stepped, so that every micro-batch of the step is counted.
        step = self.gate.end(trainer.global_step)
        if step is None:  # more micro-batches of the step are to come
            return
        with self._sink.gathered(trainer):  # each logger gets the step's scalars, histograms and figures at once
            self._emit(trainer, step)
            self._dashboard.publish(trainer, self.every(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled:
            self._dashboard.finish(trainer)
        super().on_train_end(trainer, pl_module)

    def _across(
        self, trainer: pl.Trainer, groups: set[str], per_unit: frozenset[tuple[str, str]] = frozenset()
    ) -> Across | None:
        """How to pool the states of ``groups`` over ranks (``None`` in one process); every rank must fetch with it."""
        if trainer.world_size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return None

        def agree(mine: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
            gathered: list[list[tuple[Any, ...]] | None] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, mine)
            return sorted({tuple(key) for keys in gathered for key in keys or []})

        def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            reduce_op: Any = "sum" if op == "sum" else torch.distributed.ReduceOp.MAX
            return trainer.strategy.reduce(tensor, reduce_op=reduce_op)

        tensor_parallel = tensor_parallel_mesh(trainer)
        if tensor_parallel is None:
            return Across(frozenset(groups), agree, reduce)
        group = tensor_parallel.get_group()

        def replicas(tensor: torch.Tensor) -> torch.Tensor:
            copies = tensor.new_empty(tensor_parallel.size() * tensor.shape[0], *tensor.shape[1:])
            torch.distributed.all_gather_into_tensor(copies, tensor, group=group)
            return copies.view(-1, *tensor.shape)

        # An output gradient is laid out as the output it is of; HealthMonitor's vectors decide for themselves.
        outputs = {
            "act": "act",
            "out": "fwd",
            "units": "units",
            "sat": "sat",
            "input": "input",
            "taken": "taken",
            "entry": "entry",
        }
        return Across(frozenset(groups), agree, reduce, replicas, tensor_parallel.get_local_rank(), outputs, per_unit)

    def _log_group(self, trainer: pl.Trainer, prefix: str, fetched: Fetched, group: str, step: int) -> None:
        """Log the chosen :func:`metrics` of ``group`` and hand its states to the dashboard."""
        self._sink.scalars(trainer, metrics(prefix, fetched, group, self.stats), step)
        self._dashboard.add_rows(prefix, {name: s for (g, name), s in fetched.states.items() if g == group}, step)

    def _log_histograms(
        self, trainer: pl.Trainer, prefix: str, hists: dict[tuple[str, str], Histogram], step: int
    ) -> None:
        """``{prefix}{name}`` for each key's histogram that counted something, sent together."""
        self._sink.histograms(trainer, {f"{prefix}{name}": hist for (_, name), hist in hists.items() if hist.num}, step)


def metrics(prefix: str, fetched: Fetched, group: str, stats: Sequence[str]) -> dict[str, float]:
    """``{prefix}{stat}/{name}`` for each key of ``group`` with values and each of ``stats``."""
    columns = [(stat, STATS.index(stat)) for stat in stats]
    return {
        f"{prefix}{stat}/{name}": values[i]
        for (g, name), values in fetched.stats.items()
        if g == group
        for stat, i in columns
    }
