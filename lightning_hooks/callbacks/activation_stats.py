"""ActivationStats: per-layer statistics of module outputs, on logging steps only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from typing_extensions import override

from lightning_hooks.callbacks.base import StatsCallback
from lightning_hooks.core.compiled import Region
from lightning_hooks.recorders.activations import ActivationRecorder

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = ["ActivationStats"]

ActivationStat = Literal["mean", "std", "abs_max", "zero_frac", "nonfinite"]
ACTIVATION_STATS: tuple[ActivationStat, ...] = ("mean", "std", "abs_max", "zero_frac", "nonfinite")


class ActivationStats(StatsCallback):
    """Log statistics of every selected module's outputs every ``log_every_n_steps`` optimizer steps.

    On a logging step, a forward hook on each selected module reduces every floating-point tensor
    of its output (nested outputs too) on the device; they are logged at the step once the optimizer
    has stepped. Under DDP the figures are pooled across ranks, those of the global batch; histograms
    are rank zero's own. A module's calls and all micro-batches of a step pool into one figure. On
    other steps no hook is attached. Validation, sanity check and activation checkpointing's
    recompute are never counted. Inside a ``torch.compile``'d region the hooks stay for the fit,
    switched by a flag (README, "torch.compile").

    Tags (``<layer>`` is the qualified module name, ``root`` for the LightningModule, followed by
    ``.out.<path>`` for a tensor inside a nested output such as ``lstm.out.0``):

    * ``act_mean/<layer>``, ``act_std/<layer>`` (population std), ``act_abs_max/<layer>``
    * ``act_zero_frac/<layer>``: share of exact zeros, the dead-ReLU detector
    * ``act_nonfinite/<layer>``: how many values are NaN or Inf
    * ``act/<layer>``: histogram (TensorBoard, W&B, MLflow), when ``histograms=True``
    * ``figures/activation_zero_frac``: image (TensorBoard, W&B, MLflow), every ``figure_every_n_steps``

    Args:
        log_every_n_steps: Logging period in optimizer steps; ``None`` uses the Trainer's.
        stats: Which statistics to log (default: all of ``mean``, ``std``, ``abs_max``,
            ``zero_frac``, ``nonfinite``).
        histograms: Also log a histogram per output, counted on device from at most 65,536
            evenly spaced elements.
        include: Glob patterns over qualified module names (``""`` is the LightningModule).
        exclude: Glob patterns of modules to leave out.
        types: Class names of modules to watch, matched along the class hierarchy.
        max_depth: Watch modules at most this many levels below the LightningModule.
        figure_every_n_steps: Draw ``figures/activation_zero_frac`` (each layer's share of zeros,
            in call order) on logging steps that are multiples of this. ``None``: every 10 logging
            periods, skipping figures that would make drawing them take over 1 % of the fit's time
            (the last skipped one is drawn when training ends). Needs matplotlib (the ``plots`` extra).
        figures: ``None`` draws the figures when matplotlib is installed and says nothing when it is not;
            ``True`` also warns once when it is not (as a ``figure_every_n_steps`` does); ``False`` draws no
            figure at all, so matplotlib is never loaded. Everything else is logged either way.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import ActivationStats
        >>> trainer = Trainer(callbacks=[ActivationStats(types=["ReLU"], stats=["zero_frac"])], logger=False)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        stats: list[ActivationStat] | None = None,
        histograms: bool = False,
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
            allowed_stats=ACTIVATION_STATS,
            histograms=histograms,
            include=include,
            exclude=exclude,
            types=types,
            max_depth=max_depth,
            figure_every_n_steps=figure_every_n_steps,
            figures=figures,
        )
        self._recorder = ActivationRecorder(self._batch, self.histograms, self._fired)

    @override
    def _arm_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.prepend = self._tensor_parallel
        self._recorder.attach(self._eager_modules, self._step_handles)

    @override
    def _attach_compiled(self, modules: list[tuple[str, nn.Module, Region]]) -> None:
        self._recorder.attach_switched(modules, self._handles, self._pending)

    @override
    def _emit(self, trainer: pl.Trainer, step: int) -> None:
        self._check_fired(trainer, step)
        fetched = self._batch.fetch(self._across(trainer, {"act"}))
        self._log_group(trainer, "act_", fetched, "act", step)
        self._log_histograms(trainer, "act/", fetched.histograms, step)
