"""GradStats: per-parameter and per-layer gradient statistics, on logging steps only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from typing_extensions import override

from lightning_hooks.callbacks.base import StatsCallback, data_parallel_size, loss_scaler, metrics, refuse_sharded
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.compiled import Region
from lightning_hooks.core.select import trainable_parameters
from lightning_hooks.core.shards import is_sharded
from lightning_hooks.recorders.gradients import OutputGradRecorder, ParamGradRecorder, update_ratio
from lightning_hooks.stats.state import STATS, norm_total

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = ["GradStats"]

GradStat = Literal["norm", "mean", "std", "abs_max", "zero_frac", "nonfinite"]
OUTPUT_GRAD_STATS = ("norm", "abs_max", "nonfinite")
SHARDED_GROUPS = ("param", "update", "weight")
"""What :class:`ParamGradRecorder` observes of sharded parameters, shard by shard."""


class GradStats(StatsCallback):
    """Log gradient statistics per parameter and per layer every ``log_every_n_steps`` optimizer steps.

    **Parameter gradients** are read in ``on_before_optimizer_step``: after AMP unscaling, gradient
    accumulation and the DDP all-reduce, before gradient clipping. **Layer output gradients** (a full
    backward hook's ``grad_output``) are read in backward, also for outputs modified in place
    (``ReLU(inplace=True)``), and divided by a ``GradScaler``'s scale: all figures are of the true
    gradient. On other steps no hook is attached; inside a ``torch.compile``'d region the hooks stay
    for the fit, switched by a flag (README, "torch.compile"). Under FSDP2 (``ModelParallelStrategy``
    with ``fully_shard``) each process reads its own shard and the figures are pooled, those of the
    whole gradient; histograms are of rank zero's shard.

    Tags (``<param>`` is a qualified parameter name such as ``features.0.weight``; ``<layer>`` a
    qualified module name, ``root`` for the LightningModule, with ``.out.<path>`` for nested outputs):

    * ``grad_norm/<param>``, ``grad_mean/…``, ``grad_std/…``, ``grad_abs_max/…``,
      ``grad_zero_frac/…``, ``grad_nonfinite/…``; ``grad_norm_total`` over all watched parameters
    * ``update_ratio/<param>``: ``||Δw|| / ||w||`` across the optimizer step
    * ``grad/<param>``: histogram (TensorBoard, W&B, MLflow), when ``histograms=True``
    * ``figures/gradient_flow``: image (TensorBoard, W&B, MLflow), every ``figure_every_n_steps``
    * ``out_grad_norm/<layer>``, ``out_grad_abs_max/<layer>``, ``out_grad_nonfinite/<layer>``

    Args:
        log_every_n_steps: Logging period in optimizer steps; ``None`` uses the Trainer's.
        stats: Which parameter-gradient statistics to log (default: all of ``norm``, ``mean``,
            ``std``, ``abs_max``, ``zero_frac``, ``nonfinite``); output gradients log those of
            ``norm``, ``abs_max``, ``nonfinite`` that are chosen.
        histograms: Also log a histogram of each parameter's gradient.
        param_grads: Log parameter-gradient statistics and ``grad_norm_total``.
        output_grads: Log layer output-gradient statistics.
        update_ratio: Log ``update_ratio/<param>`` (keeps a copy of the watched parameters on
            logging steps).
        include: Glob patterns over qualified module names (``""`` is the LightningModule).
        exclude: Glob patterns of modules to leave out.
        types: Class names of modules to watch, matched along the class hierarchy.
        max_depth: Watch modules at most this many levels below the LightningModule.
        figure_every_n_steps: Draw ``figures/gradient_flow`` (mean and max ``|gradient|`` of each
            layer's parameters, in model order) on logging steps that are multiples of this.
            ``None``: every 10 logging periods, skipping figures that would make drawing them take
            over 1 % of the fit's time (the last skipped one is drawn when training ends).
            Needs matplotlib (the ``plots`` extra).
        figures: ``None`` draws the figures when matplotlib is installed and says nothing when it is not;
            ``True`` also warns once when it is not (as a ``figure_every_n_steps`` does); ``False`` draws no
            figure at all, so matplotlib is never loaded. Everything else is logged either way.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import GradStats
        >>> trainer = Trainer(callbacks=[GradStats(log_every_n_steps=100, output_grads=False)], logger=False)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        stats: list[GradStat] | None = None,
        histograms: bool = False,
        param_grads: bool = True,
        output_grads: bool = True,
        update_ratio: bool = True,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
        figure_every_n_steps: int | None = None,
        figures: bool | None = None,
    ) -> None:
        super().__init__(
            log_every_n_steps=log_every_n_steps,
            stats=stats,
            allowed_stats=STATS,
            histograms=histograms,
            include=include,
            exclude=exclude,
            types=types,
            max_depth=max_depth,
            figure_every_n_steps=figure_every_n_steps,
            figures=figures,
        )
        self.param_grads = _validate.boolean("GradStats", "param_grads", param_grads)
        self.output_grads = _validate.boolean("GradStats", "output_grads", output_grads)
        self.update_ratio = _validate.boolean("GradStats", "update_ratio", update_ratio)
        if not (param_grads or output_grads):
            raise ValueError("`GradStats` got `param_grads=False` and `output_grads=False`; enable at least one.")
        self._params: list[tuple[str, nn.Parameter]] = []
        self._sharded = False  # some parameter is sharded (FSDP2): its states are pooled across processes
        self._outputs = OutputGradRecorder(self._batch, fired=self._fired)
        self._grads = ParamGradRecorder(self._batch, self.histograms, update_ratio)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self.param_grads:
            refuse_sharded(trainer.strategy, "`GradStats(param_grads=True)`", "set `param_grads=False`")

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        super()._attach(trainer, pl_module, modules)
        self._params = trainable_parameters(modules)
        self._sharded = any(is_sharded(param) for _, param in self._params)
        self._grads.pooled = self._sharded
        self._outputs.scaler = loss_scaler(trainer)

    @override
    def _detach(self) -> None:
        super()._detach()
        self._params = []

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_params": []}

    @override
    def _start_step(self) -> None:
        self._grads.start()

    @override
    def _arm_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_grads:
            self._outputs.prepend = self._tensor_parallel
            self._outputs.attach(self._eager_modules, self._step_handles)

    @override
    def _attach_compiled(self, modules: list[tuple[str, nn.Module, Region]]) -> None:
        if self.output_grads:
            self._outputs.attach_switched(modules, self._handles, self._pending)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # With several optimizers (manual optimization) each reads the parameters it is about to update.
        if self.param_grads and self._enabled and self.gate.is_open:
            self._grads.record(self._params, optimizer, self._step_handles)

    @override
    def _emit(self, trainer: pl.Trainer, step: int) -> None:
        if self.output_grads:
            self._check_fired(trainer, step)
        # Layer output gradients are per rank; parameter gradients are all-reduced (DDP) or sharded (FSDP2).
        fetched = self._batch.fetch(self._across(trainer, {"out", "fwd", *(SHARDED_GROUPS if self._sharded else ())}))
        self._log_group(trainer, "grad_", fetched, "param", step)
        scalars: dict[str, float] = {}
        params = [s for (group, _), s in fetched.states.items() if group == "param"]
        if params:
            scalars["grad_norm_total"] = norm_total(params)
        scalars.update({f"update_ratio/{name}": value for (_, name), value in fetched.scalars.items()})
        for (group, name), change in fetched.states.items():  # sharded parameters' (FSDP2)
            if group == "update":
                scalars[f"update_ratio/{name}"] = update_ratio(change, fetched.states[("weight", name)])
        out_stats = [s for s in OUTPUT_GRAD_STATS if s in self.stats] or list(OUTPUT_GRAD_STATS)
        # Each data-parallel rank's output gradients are of its own loss; training minimises the ranks' mean loss
        # (DDP and FSDP average the gradients), whose gradients are theirs over the data-parallel size.
        share = 1.0 / data_parallel_size(trainer)
        out = metrics("out_grad_", fetched, "out", out_stats)
        scalars.update({tag: v if tag.startswith("out_grad_nonfinite") else v * share for tag, v in out.items()})
        self._sink.scalars(trainer, scalars, step)
        self._log_histograms(trainer, "grad/", fetched.histograms, step)
