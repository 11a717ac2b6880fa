"""HealthMonitor: reads the statistics for you and names what is wrong, where, and since when."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_hooks.callbacks.base import (
    StatsCallback,
    data_parallel_size,
    loss_scaler,
    overflow_flags,
    refuse_sharded,
)
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.autograd import dense_gradient, loss_scale
from lightning_hooks.core.compiled import Region
from lightning_hooks.core.select import is_layer, label, trainable_parameters
from lightning_hooks.core.shards import counted_part, is_sharded, replica_part
from lightning_hooks.diagnose.checks import STEPLESS, stepless
from lightning_hooks.diagnose.health import (
    CHECKS,
    Check,
    HealthFinding,
    HealthTracker,
    Snapshot,
    Thresholds,
)
from lightning_hooks.diagnose.report import COLUMNS, rows, summary, warning
from lightning_hooks.recorders.activations import UnitRecorder
from lightning_hooks.recorders.gradients import ParamGradRecorder, gradient_norms
from lightning_hooks.recorders.readings import (
    BATCH_NORMS,
    Layers,
    fingerprints,
    layer_gradients,
    layer_outputs,
    layer_updates,
    pruned_units,
    ungraded_weights,
    watch_batch,
)
from lightning_hooks.recorders.steps import CARRY_SAMPLE, Carried, LossRing, Settings, carried_layers
from lightning_hooks.sinks.sink import echo
from lightning_hooks.stats.batch import Fetched
from lightning_hooks.stats.state import STATS

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = ["HealthMonitor"]

TABLE_TAG = "health/findings"
ACTIVATION_CHECKS = {"dead_units", "activation_growth", "nonfinite", "saturation", "no_learning", "input_scale"}
GRADIENT_CHECKS = {"vanishing_gradients", "exploding_gradients", "update_ratio", "nonfinite", "no_learning"}


class HealthMonitor(StatsCallback):
    """Apply the rules of "what healthy and unhealthy look like" to the statistics, and name the layer.

    Every ``log_every_n_steps`` optimizer steps it gathers the outputs of each selected leaf module
    (:func:`~lightning_hooks.core.select.is_layer`), the parameter gradients and the update ratio ``||Δw|| / ||w||``
    of each layer, pooled across DDP ranks, and runs its checks (every rank computes them, rank zero writes):

    * ``dead_units``: ``dead_fraction`` of a layer's units zero for every sample of a window of checks.
    * ``vanishing_gradients``: a layer learning ``gradient_spread`` times less than its peers (update ratio; under
      SGD also mean ``|gradient|``), or a gradient shrinking that much along the depth toward the input.
    * ``exploding_gradients``: the gradient norm rising steadily ``norm_growth``-fold, or one SGD step moving a
      layer by 1,000 times its weights.
    * ``update_ratio``: ``||Δw|| / ||w||`` outside ``[update_ratio_low, update_ratio_high]`` (above it only for a
      parameter group at ten times its peers' SGD rate; below it only while the learning rate is at its peak:
      a warm-up or decay makes small steps by design).
    * ``activation_growth``: an output RMS ``activation_growth`` times the layers' before it, or its own.
    * ``nonfinite``: NaN/Inf in an output, a gradient or the loss (and what a :class:`NonFiniteGuard` found);
      not the overflowing gradients of a step an fp16 ``GradScaler`` skips while its scale stays at least 1.
    * ``loss_spike``: a loss ``spike_threshold`` robust deviations above the median of the last 100 steps.
    * ``saturation``, ``input_scale``, ``no_learning``: saturated sigmoid/tanh/softmax outputs, batch
      tensors far from unit scale or batches of one class in turn, every gradient exactly zero.

    Noisy checks need ``patience`` consecutive logging steps; conclusive evidence is reported at once.
    A finding that keeps holding has its ``last_step`` advanced. Each new finding is warned once; the
    table of findings is logged as text ``health/findings`` when a new one appears, the scalars
    ``health/<check>`` (how many layers are affected) at every logging step, and a summary is printed
    when the fit ends; :attr:`findings` holds them. Without a logger it still checks, warns, prints and
    keeps findings.

    Args:
        log_every_n_steps: Checking period in optimizer steps; ``None`` uses the Trainer's.
        checks: Which checks to run (default: all of them).
        include: Glob patterns over qualified module names (``""`` is the LightningModule).
        exclude: Glob patterns of modules to leave out.
        types: Class names of modules to watch, matched along the class hierarchy.
        max_depth: Watch modules at most this many levels below the LightningModule.
        dead_fraction: Share of a layer's units that must be dead (0.7).
        gradient_spread: How many times less than its peers a layer must learn (1e3: three orders of
            magnitude).
        norm_growth: How many times the total gradient norm must grow over a steady rise (100).
        update_ratio_low: The lowest healthy ``||Δw|| / ||w||`` per step (1e-6).
        update_ratio_high: The highest healthy ``||Δw|| / ||w||`` per step (0.1).
        activation_growth: How many times a layer's output RMS may exceed that of the layers before
            it, or its own once the run settled (1e3).
        spike_threshold: How many robust deviations above the rolling median a loss spike is (20).
        patience: Consecutive logging steps a persistent problem must hold before it is reported (3).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import HealthMonitor
        >>> monitor = HealthMonitor(checks=["dead_units", "nonfinite"])
        >>> trainer = Trainer(callbacks=[monitor], logger=False)
        >>> monitor.findings
        []
    """

    needs_logger = False

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        checks: list[Check] | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
        dead_fraction: float = 0.7,
        gradient_spread: float = 1e3,
        norm_growth: float = 100.0,
        update_ratio_low: float = 1e-6,
        update_ratio_high: float = 0.1,
        activation_growth: float = 1e3,
        spike_threshold: float = 20.0,
        patience: int = 3,
    ) -> None:
        super().__init__(
            log_every_n_steps=log_every_n_steps,
            stats=None,
            allowed_stats=STATS,
            histograms=False,
            include=include,
            exclude=exclude,
            types=types,
            max_depth=max_depth,
        )
        owner = type(self).__name__
        self.checks: list[str] = _validate.subset(owner, "checks", checks, CHECKS) or list(CHECKS)
        fraction = _validate.positive_float(owner, "dead_fraction", dead_fraction)
        if fraction > 1:
            raise ValueError(f"`{owner}` got `dead_fraction={dead_fraction!r}`; `dead_fraction` must be in (0, 1].")
        limits = {
            arg: _validate.positive_float(owner, arg, value)
            for arg, value in (
                ("gradient_spread", gradient_spread),
                ("norm_growth", norm_growth),
                ("update_ratio_low", update_ratio_low),
                ("update_ratio_high", update_ratio_high),
                ("activation_growth", activation_growth),
                ("spike_threshold", spike_threshold),
            )
        }
        for arg in ("gradient_spread", "norm_growth", "activation_growth"):
            if limits[arg] <= 1:
                raise ValueError(f"`{owner}` got `{arg}={limits[arg]!r}`; `{arg}` must be a number above 1.")
        if limits["update_ratio_low"] >= limits["update_ratio_high"]:
            raise ValueError(
                f"`{owner}` got `update_ratio_low={update_ratio_low!r}` and `update_ratio_high={update_ratio_high!r}`; "
                f"`update_ratio_low` must be below `update_ratio_high`."
            )
        _validate.positive_int(owner, "patience", patience, allow_none=False)
        self.thresholds = Thresholds(dead_fraction=fraction, patience=patience, **limits)
        self._tracker = HealthTracker(self.checks, self.thresholds)
        on = set(self.checks)
        self._watch_outputs = bool(on & ACTIVATION_CHECKS)
        self._watch_grads = bool(on & GRADIENT_CHECKS)
        self._spikes = "loss_spike" in on  # exploding_gradients reads the ring too when it is there
        self._units = UnitRecorder(self._batch, fired=self._fired)
        judges_learning = bool(on & {"update_ratio", "vanishing_gradients", "exploding_gradients"})
        self._grads = ParamGradRecorder(
            self._batch, update_ratio=judges_learning, weight_norms=True, observe=False, changed_shares=True
        )
        self._gradless: bool | None = None
        self._backward_now = False  # a backward ran in the logging step
        self._backwards = 0  # backward passes since the previous logging step
        self._settings = Settings()  # the optimizers' learning rates, eps and weight decay per layer
        self._leaves: list[tuple[str, nn.Module]] = []
        self._params: list[tuple[str, nn.Parameter]] = []
        self._layers = Layers()
        self._sharded = False
        self._read: set[int] = set()  # the parameters whose gradients this logging step has read
        self._missing: dict[str, nn.Parameter] = {}  # those an optimizer stepped without a gradient in this step
        self._ungraded: list[tuple[str, int]] = []  # the layers (and their parameter counts) behind this logging
        # step's ("ungraded", "weights") vector
        self._grad_names: list[list[str]] = []  # the names behind each ("grads", <i>) vector of this logging step
        self._norm_layers: list[str] = []  # the layer (module label) of each watched parameter
        self._ring: LossRing | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._overflow: list[torch.Tensor] = []  # the GradScaler's flags of this logging step's optimizer steps
        self._previous_batch_step = -1  # the optimizer steps taken when the previous batch began
        self._batch_index = -1  # the latest batch's index in its epoch
        self._carry: list[tuple[str, Carried]] = []  # under manual optimization, whether `.grad` is zeroed
        self._carried: dict[str, list[str]] = {}  # the layers of each optimizer behind a ("carried", <i>) vector
        self._checked_until = -1  # the last step checked in this fit

    def __getstate__(self) -> dict[str, Any]:
        dropped: dict[str, Any] = {"_leaves": [], "_params": [], "_ring": None, "_scaler": None, "_overflow": []}
        return {**super().__getstate__(), **dropped, "_missing": {}, "_carry": []}

    @property
    def findings(self) -> list[HealthFinding]:
        """Every finding of the current (or last) fit, in the order they were first made."""
        return self._tracker.findings

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self._watch_grads:
            refuse_sharded(trainer.strategy, "`HealthMonitor`", "leave the gradient checks out of `checks`")

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        super()._attach(trainer, pl_module, modules)
        self._tracker = HealthTracker(self.checks, self.thresholds)
        self._checked_until = -1
        self._stepped_at, self._stepless = -1, 0  # the global step at the last batch, and batches since it changed
        leaves = [(name, m) for name, m in modules if is_layer(name, m)]
        eager = {id(m) for _, m in self._eager_modules}
        self._leaves = [(name, m) for name, m in leaves if id(m) in eager]
        compiled = [label(name) for name, m in leaves if id(m) not in eager]
        if compiled and self._watch_outputs:
            shown = ", ".join(compiled[:6]) + (f", ... ({len(compiled) - 6} more)" if len(compiled) > 6 else "")
            rank_zero_warn(
                f"`HealthMonitor` does not count units inside torch.compile'd regions: the checks that read layer "
                f"outputs (dead_units, activation_growth, and nonfinite outputs) leave out {shown}; the gradient "
                f"checks still cover their parameters. Watch them with `ActivationStats`, which observes compiled "
                f"regions."
            )
        self._params = trainable_parameters(modules)
        self._layers = Layers.of_model(modules, self._leaves, self._params)
        self._norm_layers = [self._layers.owner[name] for name, _ in self._params]
        self._settings = Settings()
        self._sharded = any(is_sharded(p) for _, p in self._params)
        self._ring = None
        self._scaler = loss_scaler(trainer)
        if self._spikes and self._enabled and self._params:
            device = self._params[0][1].device
            self._ring = LossRing(
                [p for _, p in self._params], self.every(trainer) + 1, device, self.thresholds.spike_threshold
            )

    @override
    def _attach_compiled(self, modules: list[tuple[str, nn.Module, Region]]) -> None:
        """Nothing: the unit counts are not traced into compiled graphs."""

    @override
    def _detach(self) -> None:
        super()._detach()
        self._leaves, self._params, self._ring = [], [], None

    @override
    def _start_step(self) -> None:
        self._grads.start()
        self._read, self._grad_names, self._missing = set(), [], {}
        self._units.start()
        self._gradless = None  # no optimizer stepped yet in this logging step
        self._backward_now = False
        self._settings.start()
        self._overflow = []
        self._carry, self._carried = [], {}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._previous_batch_step = self.batch_step  # due_step reads this batch's (global_step: a chain of properties)
        self._batch_index = batch_idx
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._batch.open and ("input_scale" in self.checks or "saturation" in self.checks):
            watch_batch(self._units, self._batch, batch, inputs="input_scale" in self.checks)

    @override
    def _arm_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._watch_outputs:
            self._units.prepend = self._tensor_parallel
            self._units.activations = not self._tensor_parallel  # a shard's inputs are not its maker's units
            self._units.attach(self._leaves, self._step_handles)
        manual = not pl_module.automatic_optimization  # Lightning zeroes `.grad` itself otherwise
        stepped_before = self._previous_batch_step not in (-1, self.batch_step)  # the previous batch stepped
        if manual and stepped_before and not self._carry and "exploding_gradients" in self.checks:
            trainable = [(name, p) for name, p in self._params if p.requires_grad]  # a backbone frozen since setup
            for name, p in sorted(trainable, key=lambda named: named[1].numel())[:CARRY_SAMPLE]:
                self._carry.append((name, Carried(p)))
                self._step_handles.add(p.register_hook(self._carry[-1][1]))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._backwards += 1
        self._backward_now |= self._batch.open
        if self._ring is not None:
            self._ring.loss(self._step_now(), loss)
        if "saturation" in self.checks and self._batch.open:
            self._units.watch_last_squashed()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        overflow = overflow_flags(self._scaler, optimizer)
        norms = None  # the watched gradients' 2-norms, where this logging step read them all
        if self._watch_grads and self._enabled and self.gate.is_open:
            self._overflow += overflow
            self._settings.read(optimizer, self._layers.of)
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            norms = self._record_grads(stepped)
            self._record_carried(stepped)
            self._grads.record(self._params, optimizer, self._step_handles)
        if self._ring is not None:
            self._ring.norms(self._step_now(), logging=self.gate.is_open, overflow=overflow, taken=norms)

    def _record_carried(self, stepped: set[int]) -> None:
        """Under manual optimization, for the followed parameters that the optimizer steps (the ids ``stepped``):
        whether ``.grad`` held gradients from before its previous step (see :class:`Carried`), and the layers it
        steps."""
        found = [row for _, hook in self._carry if id(hook.param) in stepped and (row := hook.evidence()) is not None]
        if found:
            key = str(len(self._carried))
            self._carried[key] = list(dict.fromkeys(self._layers.owner[n] for n, p in self._params if id(p) in stepped))
            self._batch.add_vector(("carried", key), torch.cat(found))

    def _step_now(self) -> int:
        """The current batch's optimizer step, read once at its start: the recorded one, or :meth:`due_step`'s."""
        return self.batch_step if self.gate.step is None else self.gate.step

    def _record_grads(self, stepped: set[int]) -> torch.Tensor | None:
        """Each watched gradient's L1 norm and squared L2 norm, of the parameters the optimizer steps (the ids
        ``stepped``), as one vector (not read twice, and added up over processes where some parameter is sharded);
        and which of them it steps without a gradient. Their L2 norms when they are every watched gradient and none is
        sharded: the ring's row of the step."""
        read = [(n, p) for n, p in self._params if p.grad is not None and id(p) in stepped and id(p) not in self._read]
        self._missing.update((n, p) for n, p in self._params if p.grad is None and p.requires_grad and id(p) in stepped)
        self._gradless = self._gradless is not False and not read and any(id(p) in stepped for _, p in self._params)
        if read:
            self._read.update(id(p) for _, p in read)
            # pooled over processes (some parameter sharded), a plain parameter is the same on every rank: rank 0's
            grads: list[torch.Tensor] = [p.grad for _, p in read]  # type: ignore[misc]
            part = [counted_part(g) if is_sharded(g) or not self._sharded else replica_part(g) for g in grads]
            values = gradient_norms([dense_gradient(g) for g in part])
            self._grad_names.append([name for name, _ in read])
            self._batch.add_vector(("grads", str(len(self._grad_names) - 1)), values)
            if len(read) == len(self._params) and not self._sharded:
                return values[len(read) :].sqrt()
        return None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        if self._enabled:
            echo(summary(self.findings, trainer.global_step))

    @override
    def _emit(self, trainer: pl.Trainer, step: int) -> None:
        if self._watch_outputs:
            self._check_fired(trainer, step, self._leaves)  # only the leaves are hooked: a container is not silent
        self._units.last_squashed = self._units.last_clamped = None  # a forward no backward followed: not kept
        self._units.made, self._units.sums = {}, {}  # nor its autograd nodes, nor the batch sums it kept
        ring_steps, with_norms = self._ring.hand_over(self._batch) if self._ring is not None else ([], set())
        scale = loss_scale(self._scaler)  # as updated after the step
        if self._overflow and scale is not None:
            self._batch.add_vector(
                ("scaler", "overflow"), torch.stack([torch.stack(self._overflow).sum(), scale.reshape(())])
            )
        if self._watch_outputs and "dead_units" in self.checks:
            for name, units in pruned_units(self._leaves):
                self._batch.add_vector(("pruned", name), units)
            self._units.add_shared()
        self._units.per_source = {}  # nor the unit sums it kept
        if self._watch_outputs and "no_learning" in self.checks:
            self._add_ungraded()
        # Gradients are all-reduced under DDP; under FSDP2 each process has its shard's norms, pooled here.
        sharded = {"grads", "update", "weight"} if self._sharded else set()
        per_unit = frozenset(self._units.per_unit)
        fetched = self._batch.fetch(
            self._across(trainer, {"units", "fed", "after", "sat", "input", "taken", "entry", *sharded}, per_unit)
        )
        snap = self._snapshot(fetched, step, ring_steps, with_norms, trainer)
        self._carry, self._missing = [], {}  # the zero_grad hooks' sign copies are not kept to the next logging step
        self._backwards = 0
        self._checked_until = step
        new = self._tracker.update(snap)
        if self._ring is not None:
            self._ring.halfway = self._tracker.halfway()
        self._publish(trainer, new, step)
        affected = self._tracker.affected
        self._sink.scalars(trainer, {f"health/{check}": float(affected.get(check, 0)) for check in self.checks}, step)

    def _publish(self, trainer: pl.Trainer, new: list[HealthFinding], step: int) -> None:
        """Warn each new finding once, and log the table of findings when there is one."""
        for finding in new:
            rank_zero_warn(warning(finding))
        if new:
            self._sink.table(
                trainer, TABLE_TAG, COLUMNS, rows(self.findings), step, caption=f"HealthMonitor, step {step}"
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if pl_module.automatic_optimization or "no_learning" not in self.checks or not self._enabled:
            return  # Lightning steps the optimizer itself (or skips a batch whose step returned None: no_backward)
        step = trainer.global_step
        self._stepless = self._stepless + 1 if step == self._stepped_at else 0
        self._stepped_at = step
        if self._stepless and self._stepless % STEPLESS == 0:  # said once, then its last step kept up to date
            with self._sink.gathered(trainer):
                self._publish(trainer, self._tracker.record(stepless(self._stepless, step)), step)

    def _unoptimized(self, trainer: pl.Trainer) -> frozenset[str]:
        """The layers with a parameter that has a gradient but is in none of the Trainer's optimizers (none when there
        is no optimizer: the model is stepped by hand). Not a batch norm under Lightning's ``BaseFinetuning``: it leaves
        a frozen backbone's batch norms trainable (``train_bn``), or makes them so when it unfreezes, outside the
        optimizer."""
        if not trainer.optimizers:
            return frozenset()
        stepped = {
            id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        if any(isinstance(callback, BaseFinetuning) for callback in trainer.callbacks):  # type: ignore[attr-defined]
            norms = [m for m in trainer.lightning_module.modules() if isinstance(m, BATCH_NORMS)]
            stepped |= {id(p) for norm in norms for p in norm.parameters()}
        owner = self._layers.owner
        return frozenset(owner[name] for name, p in self._params if p.grad is not None and id(p) not in stepped)

    def _add_ungraded(self) -> None:
        """The fingerprints of the leaves that ran but got no gradient (see :func:`ungraded_weights`)."""
        graded = {self._layers.owner[name] for name, p in self._params if id(p) in self._read}
        self._ungraded, sums = ungraded_weights(self._units, graded, self._missing, self._layers.owner)
        if sums is not None:
            self._batch.add_vector(("ungraded", "weights"), sums)

    def _snapshot(
        self, fetched: Fetched, step: int, ring_steps: list[int], with_norms: set[int], trainer: pl.Trainer
    ) -> Snapshot:
        outputs = layer_outputs(fetched, self._units, data_parallel_size(trainer), self._layers)
        ratios, weight_norms, changed = layer_updates(fetched, self._layers)
        losses, norms = self._ring.rows(fetched, ring_steps, with_norms) if self._ring is not None else ([], [])
        overflow, scale = fetched.vectors.get(("scaler", "overflow"), [0.0, math.nan])
        return Snapshot(
            step=step,
            **vars(outputs),
            **self._layers.facts(self._settings.eps),
            adaptive=frozenset(self._settings.adaptive),
            lrs=self._settings.lrs,
            eps=self._settings.eps,
            decay=self._settings.decay,
            gradless=bool(self._gradless),
            backward=self._backward_now,
            backwards=self._backwards,
            automatic=trainer.lightning_module.automatic_optimization,
            clip=_clipping(trainer),
            stepwise=any(config.interval == "step" for config in trainer.lr_scheduler_configs),
            skipped_at_scale=scale if overflow > 0 else None,
            grads=layer_gradients(fetched, self._grad_names, self._layers),
            ratios=ratios,
            weights=weight_norms,
            changed=changed,
            losses=losses,
            norms=norms,
            norm_layers=self._norm_layers,
            unoptimized=self._unoptimized(trainer) if self._watch_grads else frozenset(),
            carried=carried_layers(fetched, self._carried),
            ungraded=fingerprints(fetched, self._ungraded),
            total_steps=_total_steps(trainer),
            batch_index=self._batch_index,
            guard=_guard_finding(trainer, self._checked_until, step),
        )


def _guard_finding(trainer: pl.Trainer, after: int, step: int) -> tuple[str, int, str] | None:
    """``(layer, step, first line)`` of what a :class:`NonFiniteGuard` of the Trainer found in ``(after, step]``."""
    from lightning_hooks.callbacks.nonfinite_guard import NonFiniteGuard

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        found = callback.last_finding if isinstance(callback, NonFiniteGuard) else None
        if found is not None and after < found.step <= step:
            return found.layer, found.step, found.lines(found.step)[0]
    return None


def _total_steps(trainer: pl.Trainer) -> float:
    """The optimizer steps the fit will take, ``inf`` when not known (an endless or unsized loader)."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except MisconfigurationException:  # an accumulation that changes with the epoch
        return math.inf
    return total if total > 0 else math.inf


def _clipping(trainer: pl.Trainer) -> tuple[str, float] | None:
    """Lightning's gradient clipping under automatic optimization: its algorithm (``norm`` by default) and value."""
    value = trainer.gradient_clip_val
    if not value or not trainer.lightning_module.automatic_optimization:
        return None
    algorithm = trainer.gradient_clip_algorithm
    return (algorithm.value if algorithm is not None else "norm"), float(value)
