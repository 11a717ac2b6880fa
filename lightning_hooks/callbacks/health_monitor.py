"""HealthMonitor: reads the statistics for you and names what is wrong, where, and since when."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
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
from lightning_hooks.core.nested import named_tensors
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
from lightning_hooks.recorders.steps import CARRY_MATCH, CARRY_SAMPLE, Carried, LossRing, learning_rate, weight_decay
from lightning_hooks.sinks.sink import echo
from lightning_hooks.stats.batch import Fetched
from lightning_hooks.stats.state import STATS, State, combine

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = ["HealthMonitor"]

TABLE_TAG = "health/findings"
ACTIVATION_CHECKS = {"dead_units", "activation_growth", "nonfinite", "saturation", "no_learning", "input_scale"}
SQUASHING = {torch.nn.Sigmoid: "sigmoid", torch.nn.Tanh: "tanh", torch.nn.Softmax: "softmax"}
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
NORMS = (
    *BATCH_NORMS,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
)
GRADIENT_CHECKS = {"vanishing_gradients", "exploding_gradients", "update_ratio", "nonfinite", "no_learning"}


class HealthMonitor(StatsCallback):
    """Apply the rules of "what healthy and unhealthy look like" to the statistics, and name the layer.

    Every ``log_every_n_steps`` optimizer steps it gathers the outputs of each selected leaf module
    (:func:`~lightning_hooks.core.select.is_layer`),
    the parameter gradients and the update ratio ``||Δw|| / ||w||`` of each layer, pooled across DDP
    ranks, and runs its checks (every rank computes them, rank zero writes):

    * ``dead_units``: ``dead_fraction`` of a layer's units zero for every sample of a window of checks.
    * ``vanishing_gradients`` / ``exploding_gradients``: a layer learning ``gradient_spread`` times less /
      more than its peers (update ratio; under SGD also mean ``|gradient|``), the gradient norm rising
      steadily ``norm_growth``-fold, or one SGD step moving a layer by 1,000 times its weights.
    * ``update_ratio``: ``||Δw|| / ||w||`` outside ``[update_ratio_low, update_ratio_high]`` (above it only for a
      parameter group at ten times its peers' learning rate; below it only while the learning rate is at its peak:
      a warm-up or decay makes small steps by design).
    * ``activation_growth``: an output RMS ``activation_growth`` times the layers' before it, or its own.
    * ``nonfinite``: NaN/Inf in an output, a gradient or the loss (and what a :class:`NonFiniteGuard` found);
      not the overflowing gradients of a step an fp16 ``GradScaler`` skips while its scale stays at least 1.
    * ``loss_spike``: a loss ``spike_threshold`` robust deviations above the median of the last 100 steps.
    * ``saturation``, ``input_scale``, ``no_learning``: saturated sigmoid/tanh/softmax outputs, batch
      tensors far from unit scale, every gradient exactly zero.

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
        gradient_spread: How many times less or more than its peers a layer must learn (1e3: three
            orders of magnitude).
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
        self._adaptive: set[str] = set()  # layers an optimizer other than SGD updates
        self._gradless: bool | None = None
        self._backward_now = False  # a backward ran in the logging step
        self._backwards = 0  # backward passes since the previous logging step
        self._squashing: dict[str, str] = {}
        self._channelwise: frozenset[str] = frozenset()
        self._normalizers: frozenset[str] = frozenset()
        self._lrs: dict[str, float] = {}  # per layer, its parameter group's learning rate at this logging step
        self._eps: dict[str, float] = {}  # and its adaptive optimizer's eps, where it has one
        self._decay: dict[str, tuple[float, float]] = {}  # and its weight decay (see `weight_decay`)
        self._embeddings: frozenset[str] = frozenset()
        self._half: dict[str, torch.dtype] = {}
        self._leaves: list[tuple[str, nn.Module]] = []
        self._params: list[tuple[str, nn.Parameter]] = []
        self._owner: dict[str, str] = {}
        self._numel: dict[str, int] = {}
        self._sharded = False
        self._read: set[int] = set()  # the parameters whose gradients this logging step has read
        self._missing: dict[str, nn.Parameter] = {}  # those an optimizer stepped without a gradient in this step
        self._ungraded: list[tuple[str, int]] = []  # the layers (and their parameter counts) behind this logging
        # step's ("ungraded", "weights") vector
        self._grad_names: list[list[str]] = []  # the names behind each ("grads", <i>) vector of this logging step
        self._norm_layers: list[str] = []  # the layer (module label) of each watched parameter
        self._order: list[str] = []
        self._with_params: frozenset[str] = frozenset()
        self._ring: LossRing | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._overflow: list[torch.Tensor] = []  # the GradScaler's flags of this logging step's optimizer steps
        self._previous_batch_step = -1  # the optimizer steps taken when the previous batch began
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
        owners = {id(p): name for name, m in modules for p in m.parameters(recurse=False)}
        self._owner = {pname: label(owners[id(p)]) for pname, p in self._params}
        self._norm_layers = [self._owner[name] for name, _ in self._params]
        self._numel = {name: p.numel() for name, p in self._params}
        self._layer_of = {id(p): self._owner[name] for name, p in self._params}
        self._sizes: dict[str, int] = {}  # parameter values per layer
        for name, n in self._numel.items():
            self._sizes[self._owner[name]] = self._sizes.get(self._owner[name], 0) + n
        self._squashing = {
            label(name): kind for name, m in self._leaves for cls, kind in SQUASHING.items() if isinstance(m, cls)
        }
        self._channelwise = frozenset(label(name) for name, m in self._leaves if isinstance(m, BATCH_NORMS))
        self._normalizers = frozenset(label(name) for name, m in self._leaves if isinstance(m, NORMS))
        self._embeddings = frozenset(label(name) for name, m in modules if isinstance(m, EMBEDDINGS))
        self._half = {  # per layer with half-precision weights, their dtype
            self._owner[name]: p.dtype for name, p in self._params if p.dtype in (torch.float16, torch.bfloat16)
        }
        self._adaptive = set()
        self._sharded = any(is_sharded(p) for _, p in self._params)
        self._order = [label(name) for name, _ in modules]
        self._with_params = frozenset(
            label(n) for n, m in modules if next(m.parameters(recurse=False), None) is not None
        )
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
        self._lrs, self._eps, self._decay = {}, {}, {}
        self._overflow = []
        self._carry, self._carried = [], {}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._previous_batch_step = self.batch_step  # due_step reads this batch's (global_step: a chain of properties)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._batch.open and ("input_scale" in self.checks or "saturation" in self.checks):
            # a previous micro-batch's were freed
            self._units.batch_tensors, self._units.batch_sizes, self._units.sums = {}, {}, {}
            floats = [(path, t) for path, t in named_tensors(batch) if t.is_floating_point() and t.numel()]
            self._units.target_numel = floats[-1][1].numel() if len(floats) > 1 else None
            if "input_scale" not in self.checks:
                return
            for i, (path, t) in enumerate(floats):
                self._batch.add_vector(("input", path), self._units.input_sums(t))
                if t.layout == torch.strided:  # which layer takes it (a sparse tensor has no one address)
                    self._units.batch_tensors[t.data_ptr()] = path
                    if i < len(floats) - 1 or len(floats) == 1:  # not the targets: no layer takes them
                        self._units.batch_sizes.setdefault(t.numel(), path)

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
            for group in optimizer.param_groups:
                lr, eps = learning_rate(group), group.get("eps")
                decay = weight_decay(optimizer, group, lr)
                for p in group["params"]:
                    if (layer := self._layer_of.get(id(p))) is not None:
                        before = self._lrs.get(layer)
                        self._lrs[layer] = lr if before is None or math.isnan(lr) else max(before, lr)
                        if isinstance(eps, float):  # Adafactor's is a pair
                            self._eps[layer] = eps
                        if decay is not None and decay[0] > self._decay.get(layer, (0.0,))[0]:
                            self._decay[layer] = decay
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not isinstance(optimizer, torch.optim.SGD):
                self._adaptive.update(layer for i in stepped if (layer := self._layer_of.get(i)) is not None)
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
            self._carried[key] = list(dict.fromkeys(self._owner[n] for n, p in self._params if id(p) in stepped))
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
            self._add_pruned()
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

    def _fingerprints(self, fetched: Fetched) -> dict[str, tuple[float, ...]]:
        """Per leaf of :meth:`_add_ungraded`, its weights' fingerprint."""
        values, layers, self._ungraded = fetched.vectors.get(("ungraded", "weights"), []), self._ungraded, []
        found, start = {}, 0
        for layer, n in layers:
            found[layer] = tuple(values[start : start + 2 * n])
            start += 2 * n
        return found

    def _carried_layers(self, fetched: Fetched) -> list[str]:
        """The layers of the optimizers each of whose followed parameters' ``.grad`` still held, when their next
        gradient came, what it held at the previous optimizer step, and still does at this one: nothing zeroed it."""
        layers: list[str] = []
        for key, names in self._carried.items():
            values = fetched.vectors.get(("carried", key), [])
            rows = list(zip(values[0::3], values[1::3], values[2::3], strict=True))
            if rows and all(
                old > 0 and abs(now - old - fresh) <= CARRY_MATCH * (old + abs(fresh)) for old, fresh, now in rows
            ):
                layers += names
        return layers

    def _unoptimized(self, trainer: pl.Trainer) -> frozenset[str]:
        """The layers with a parameter that has a gradient but is in none of the Trainer's optimizers (none when there
        is no optimizer: the model is stepped by hand)."""
        if not trainer.optimizers:
            return frozenset()
        stepped = {
            id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        return frozenset(self._owner[name] for name, p in self._params if p.grad is not None and id(p) not in stepped)

    def _add_ungraded(self) -> None:
        """A fingerprint (sum and norm) of the weights of each leaf that ran with gradients enabled in this logging step
        before the first leaf that got a gradient, but whose parameters an optimizer stepped without one, to tell at
        the next logging step whether they changed in between. Not a leaf run under ``torch.no_grad()`` (a teacher: on
        purpose), nor one that ran after a leaf that learns (a module whose output goes unused, as the pooler that
        transformers' BigBird computes and its classifier never reads): a cut from the loss leaves the layers before it
        without a gradient."""
        graded = {self._owner[name] for name, p in self._params if id(p) in self._read}
        ran: set[str] = set()
        for name in self._units.order:
            if (layer := label(name)) in graded:
                break
            if name in self._units.with_grad:
                ran.add(layer)
        layers: dict[str, list[torch.Tensor]] = {}
        for name, p in self._missing.items():
            if (layer := self._owner[name]) in ran and layer not in graded:
                layers.setdefault(layer, []).append(p.detach())
        self._ungraded = [(layer, len(ws)) for layer, ws in layers.items()]
        if layers:
            weights = [w for ws in layers.values() for w in ws]
            sums = torch.stack([torch.stack([w.sum(), torch.linalg.vector_norm(w)]) for w in weights]).float()
            self._batch.add_vector(("ungraded", "weights"), sums.flatten())

    def _add_pruned(self) -> None:
        """Per leaf pruned by ``torch.nn.utils.prune`` (a ``weight_mask`` buffer, as Lightning's ``ModelPruning``
        leaves it during the fit), which output units have every weight masked; masks change as pruning goes on."""
        for name, module in self._leaves:
            mask = getattr(module, "weight_mask", None)
            if isinstance(mask, torch.Tensor) and mask.dim() > 1 and not getattr(module, "transposed", False):
                self._batch.add_vector(("pruned", name), (mask.reshape(len(mask), -1) == 0).all(1).float())

    def _snapshot(
        self, fetched: Fetched, step: int, ring_steps: list[int], with_norms: set[int], trainer: pl.Trainer
    ) -> Snapshot:
        replicas = data_parallel_size(trainer)
        outputs: dict[str, list[State]] = {}  # a nested output's tensors pooled into their layer's
        units: dict[str, list[float]] = {}
        vectors = fetched.vectors
        for key, values in vectors.items():
            if key[0] != "units":
                continue
            layer, per_unit = key[1].split(".out.", 1)[0], key in self._units.per_unit
            sum_sq = math.fsum(values)
            # the values each unit saw: this process's count times the data-parallel processes (which see batches
            # alike), times the tensor-parallel shards added up into one sum
            numel = float(self._units.samples.get(key, 0) * len(values) * replicas * fetched.parts.get(key, 1))
            outputs.setdefault(layer, []).append(
                State(numel=numel, sum_sq=sum_sq, nonfinite=float(not math.isfinite(sum_sq)))
            )
            if per_unit:
                units.setdefault(layer, values)
        activated = {}  # a layer's units after a functional activation (another process may have seen them alone)
        for key, values in vectors.items():
            if key[0] == "fed" and key[1] in outputs and key[1] not in units:
                units[key[1]], activated[key[1]] = values, self._units.activated.get(key[1], "an operation")
        shared = {}  # a layer's units after a module without weights that also took other layers' outputs
        for key, values in vectors.items():
            if key[0] == "after" and key[1] in outputs and key[1] not in units:
                units[key[1]], shared[key[1]] = values, self._units.after.get(key[1], "a module")
        for carrier, (maker, width, ops) in self._units.carried.items():
            # a dropout or pooling module that took them: its units are the layer's
            if len(units.get(carrier, ())) == width and maker in outputs and maker not in units:
                units[maker], activated[maker] = units.pop(carrier), ops
        params: dict[str, list[State]] = {}  # a layer's parameters pooled
        for i, names in enumerate(self._grad_names):
            values, n = fetched.vectors[("grads", str(i))], len(names)
            for name, l1, l2_squared in zip(names, values[:n], values[n:], strict=True):
                state = State(
                    numel=self._numel[name], abs_sum=l1, sum_sq=l2_squared, nonfinite=float(not math.isfinite(l1))
                )
                params.setdefault(self._owner[name], []).append(state)
        squares: dict[str, list[tuple[float, float]]] = {}  # per layer, ||Δw||² and ||w||² of each parameter
        for (group, name), value in fetched.scalars.items():
            if group == "ratio":
                norm = fetched.scalars.get(("wnorm", name), math.nan)
                squares.setdefault(self._owner.get(name, name), []).append(((value * norm) ** 2, norm**2))
        for (group, name), change in fetched.states.items():  # sharded parameters: pooled squares of Δw and w
            if group == "update":
                weight = max(fetched.states[("weight", name)].sum_sq, 0.0)
                squares.setdefault(self._owner.get(name, name), []).append((max(change.sum_sq, 0.0), weight))
        weight_norms = {layer: math.sqrt(math.fsum(w for _, w in pairs)) for layer, pairs in squares.items()}
        changed: dict[str, list[tuple[float, int]]] = {}  # per half-precision layer, each parameter's changed share
        for (group, name), share in fetched.scalars.items():
            if group == "changed":
                changed.setdefault(self._owner[name], []).append((share, self._numel[name]))
        ratios = {
            layer: math.sqrt(math.fsum(c for c, _ in pairs)) / max(weight_norms[layer], 1e-12)
            for layer, pairs in squares.items()
        }
        losses: list[tuple[int, float]] = []
        norms: list[list[float]] = []
        if ring_steps:
            flat, norm_rows = fetched.vectors[("ring", "loss")], fetched.vectors.get(("ring", "norms"), [])
            overflowed = fetched.vectors.get(("ring", "overflow"), [])
            width, row = len(self._params), 0
            for i, ring_step in enumerate(ring_steps):
                losses.append((ring_step, flat[i]))
                # a step the GradScaler skipped: its gradients measure the loss scale, not the model
                taken = ring_step in with_norms and not (row < len(overflowed) and overflowed[row] > 0)
                norms.append(norm_rows[row * width : (row + 1) * width] if taken else [])
                row += ring_step in with_norms
        overflow, scale = fetched.vectors.get(("scaler", "overflow"), [0.0, math.nan])
        executed = [label(name) for name in self._units.order]
        ran = set(executed)
        output_grads = {label(k[1]): v for k, v in vectors.items() if k[0] == "rowsum" and v[1] > 0}
        clamped = {label(k[1]): v[0] / v[1] for k, v in vectors.items() if k[0] == "clamped" and v[1] > 0}
        return Snapshot(
            step=step,
            order=[*executed, *(name for name in self._order if name not in ran)],
            executed=executed,
            last_calls={label(name): call for name, call in self._units.last_call.items()},
            adaptive=frozenset(self._adaptive),
            squashing=self._squashing,
            lrs=self._lrs,
            eps=self._eps,
            decay=self._decay,
            embeddings=self._embeddings,
            gradless=bool(self._gradless),
            backward=self._backward_now,
            backwards=self._backwards,
            automatic=trainer.lightning_module.automatic_optimization,
            clip=_clipping(trainer),
            skipped_at_scale=scale if overflow > 0 else None,
            pruned={label(k[1]): [v > 0 for v in values] for k, values in vectors.items() if k[0] == "pruned"},
            channelwise=self._channelwise,
            input_takers={path: label(name) for path, name in self._units.takers.items()},
            taken={k[1]: _rms(v) for k, v in vectors.items() if k[0] == "taken"},
            entry=next(((label(k[1]), _rms(v)) for k, v in vectors.items() if k[0] == "entry"), None),
            normalizers=self._normalizers,
            weight_sizes=self._sizes,
            inputs={  # not an additive mask in every micro-batch (its fills all alike)
                k[1]: _rms(v) for k, v in vectors.items() if k[0] == "input" and v[2] < v[3]
            },
            saturated={
                label(k[1]): v[0] / max(self._units.saturable.get(k[1], 0) * replicas * fetched.parts.get(k, 1), 1)
                for k, v in vectors.items()
                if k[0] == "sat"
            },
            row_sums={layer: rows / size for layer, (rows, size, _) in output_grads.items()},
            sigmoid_misfit={layer: misfit / size for layer, (_, size, misfit) in output_grads.items()},
            clamped=clamped,
            activations={layer: combine(states) for layer, states in outputs.items()},
            units=units,
            activated=activated,
            shared=shared,
            grads={layer: combine(states) for layer, states in params.items()},
            ratios=ratios,
            weights=weight_norms,
            changed={
                layer: sum(s * n for s, n in parts) / sum(n for _, n in parts) for layer, parts in changed.items()
            },
            half={
                layer: (str(dtype).removeprefix("torch."), torch.finfo(dtype).eps)
                for layer, dtype in self._half.items()
            },
            eps_lost=frozenset(  # float16's smallest number is 6e-8: Adam's 1e-8 rounds to 0
                layer
                for layer, dtype in self._half.items()
                if (eps := self._eps.get(layer)) is not None and float(torch.tensor(eps, dtype=dtype)) == 0
            ),
            losses=losses,
            norms=norms,
            norm_layers=self._norm_layers,
            unoptimized=self._unoptimized(trainer) if self._watch_grads else frozenset(),
            carried=self._carried_layers(fetched),
            ungraded=self._fingerprints(fetched),
            total_steps=_total_steps(trainer),
            leaves_with_params=self._with_params,
            guard=_guard_finding(trainer, self._checked_until, step),
        )


def _rms(sums: list[float]) -> float:
    """The RMS of :func:`~lightning_hooks.stats.state.input_sums` added up."""
    return math.sqrt(sums[0] / max(sums[1], 1))


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
