"""What every hook callback shares: selection, the step gate and the hook lifecycle."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hooks._handles import HookHandles
from lightning_hooks._select import ModuleSelector, label
from lightning_hooks._sink import Sink
from lightning_hooks._stats import Histogram, StatBatch, derive
from lightning_hooks.callbacks._dashboard import FIGURE_PERIOD_FACTOR, Dashboard

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_positive_int(
    owner: str, arg: str, value: object, *, allow_none: bool = True, none: str = "use the Trainer's `log_every_n_steps`"
) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = f" or None ({none})" if allow_none else ""
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive integer{hint}.")


def check_positive_float(owner: str, arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number, e.g. 0.5.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number.")
    return float(value)


class HookCallback(Callback):
    """Base of the callbacks: hooks attach in ``on_fit_start`` and leave on every exit path.

    Modules are selected once per fit in ``on_fit_start`` and kept in ``self._modules``.
    Subclasses implement :meth:`_attach`; hooks that must run on every step (a gradient clamp)
    are registered there with ``self._handles``. Hooks that only observe are registered with
    ``self._step_handles`` at the start of the steps that need them and removed at their end,
    so that on every other step each module takes ``nn.Module.__call__``'s hook-free fast path.
    Both owners are emptied on every exit path of a fit: success, exception, interrupt, teardown.
    """

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
        check_positive_int(owner, "log_every_n_steps", log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.selector = ModuleSelector(include, exclude, types, max_depth, owner=owner)
        self._handles = HookHandles()
        self._step_handles = HookHandles()
        self._modules: list[tuple[str, nn.Module]] = []
        self._sink = Sink(owner)

    def every(self, trainer: pl.Trainer) -> int:
        """The logging period in optimizer steps."""
        return self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50

    def is_logging_step(self, trainer: pl.Trainer) -> bool:
        """A training (not sanity-check) step whose optimizer step is a multiple of the period."""
        return trainer.training and not trainer.sanity_checking and trainer.global_step % self.every(trainer) == 0

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        self._step_handles.remove()
        self._handles.remove()
        self._modules = []

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to another process or saved must not drag the model along.
        return {**self.__dict__, "_modules": []}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
        self._modules = self.selector.select(pl_module)
        self._attach(trainer, pl_module, self._modules)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()


def output_label(module: str, path: str) -> str:
    """``<layer>`` for a module's only output tensor, ``<layer>.out.<path>`` inside a nested output."""
    return label(module) if not path else f"{label(module)}.out.{path}"


class StatsCallback(HookCallback):
    """A callback that logs statistics on logging steps, gathered on device into a :class:`StatBatch`.

    ``_arm_step`` attaches the observing hooks at the start of each training batch of a logging
    step (they are removed at its end); ``_emit`` fetches and logs once the optimizer has stepped.
    The moment rows it logs also feed the TensorBoard custom-scalars layout of the run and, every
    ``figure_every_n_steps``, a figure (see :class:`~lightning_hooks.callbacks._dashboard.Dashboard`).
    """

    bins = 64

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
    ) -> None:
        super().__init__(
            log_every_n_steps=log_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        owner = type(self).__name__
        check_positive_int(
            owner, "figure_every_n_steps", figure_every_n_steps, none=f"{FIGURE_PERIOD_FACTOR} × the logging period"
        )
        self.figure_every_n_steps = figure_every_n_steps
        self._dashboard = Dashboard(owner, self._sink, figure_every_n_steps)
        if stats is not None:
            if isinstance(stats, str) or not isinstance(stats, Sequence):
                raise TypeError(
                    f"`{owner}` got `stats={stats!r}`; `stats` must be a list drawn from {list(allowed_stats)}."
                )
            unknown = [s for s in stats if s not in allowed_stats]
            if unknown or not stats:
                raise ValueError(
                    f"`{owner}` got `stats={list(stats)!r}`; `stats` must be a non-empty list drawn from "
                    f"{list(allowed_stats)}, or None for all of them."
                )
        if not isinstance(histograms, bool):
            raise TypeError(f"`{owner}` got `histograms={histograms!r}`; `histograms` must be True or False.")
        self.stats = list(stats) if stats is not None else list(allowed_stats)
        self.histograms = histograms
        self._batch = StatBatch()
        self._armed: int | None = None
        self._enabled = True

    def _arm_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _emit(self, trainer: pl.Trainer, step: int) -> None:
        raise NotImplementedError

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._batch.clear()
        self._armed = None
        self._enabled = bool(trainer.loggers)
        self._dashboard.start(self.every(trainer))
        if not self._enabled:
            rank_zero_warn(
                f"`{type(self).__name__}` has no logger to write to (`Trainer(logger=False)`); it does nothing."
            )

    @override
    def _detach(self) -> None:
        super()._detach()
        self._batch.clear()
        self._armed = None
        self._dashboard.reset()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled:
            return
        if self._armed is None and self.is_logging_step(trainer):
            self._armed = trainer.global_step
        if self._armed is not None:
            self._arm_step(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_handles.remove()
        if self._armed is not None and trainer.global_step != self._armed:
            step, self._armed = self._armed, None
            self._emit(trainer, step)
        self._dashboard.publish(trainer, self.every(trainer))

    def _log_rows(self, trainer: pl.Trainer, prefix: str, rows: dict[str, list[float]], step: int) -> None:
        metrics = {
            f"{prefix}{stat}/{key}": value
            for key, row in rows.items()
            for stat, value in derive(row, self.stats).items()
        }
        self._sink.scalars(trainer, metrics, step)
        self._dashboard.add_rows(prefix, rows, step)

    def _log_histograms(self, trainer: pl.Trainer, prefix: str, hists: dict[str, Histogram], step: int) -> None:
        for key, hist in hists.items():
            if hist.num:
                self._sink.histogram(trainer, f"{prefix}{key}", hist, step)
