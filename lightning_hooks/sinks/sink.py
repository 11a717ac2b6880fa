"""Where numbers go: the Trainer's loggers, each in its native form, from rank zero only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lightning_hooks.core.tables import Cell, Table
from lightning_hooks.sinks.backends import FIGURES, Backend, StepData, backend, names_showing
from lightning_hooks.stats.histogram import Histogram

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from numpy.typing import NDArray

__all__ = ["Sink", "echo"]

_Rows = Sequence[Sequence[Cell]]


@rank_zero_only
def echo(text: str, trainer: pl.Trainer | None = None) -> None:
    """Print on global rank zero only: through ``trainer``'s progress bar when it has one (during a batch, so that the
    text starts on its own line and the bar is drawn again below it), else plainly."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None:
        bar.print(text)
    else:
        print(text, flush=True)


class Sink:
    """Sends a callback's numbers, histograms, figures, text and tables from global rank zero to the Trainer's
    loggers, each what it can show in its own form (README: Loggers)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._warned: set[str] = set()
        self.tags: dict[str, None] = {}
        """Every scalar tag this sink has logged, in order (rank zero only)."""
        self._held: dict[int, StepData] | None = None
        self._held_layout: int | None = None

    def _backends(self, trainer: pl.Trainer) -> list[tuple[Logger, Backend]]:
        # `fast_dev_run` swaps the loggers for a DummyLogger, which drops everything: nothing to send it or warn about
        return [(logger, backend(logger)) for logger in trainer.loggers if not isinstance(logger, DummyLogger)]

    def _warn_unshown(self, backends: list[tuple[Logger, Backend]], kinds: Sequence[str]) -> None:
        """Warn once per unknown logger, and once per kind that no logger of the Trainer shows."""
        if not kinds:
            return
        for logger, found in backends:
            if not found.name and not found.warned:
                found.warned = True
                rank_zero_warn(
                    f"`{self.owner}` logs {', '.join(kinds)} and `{type(logger).__name__}` is not a logger "
                    "lightning_hooks knows: it gets scalars only, through its `log_metrics`, and no histograms, "
                    "figures, text or tables. TensorBoardLogger, WandbLogger, MLFlowLogger and CSVLogger get what "
                    "they can show (README: Loggers)."
                )
        if all(not found.name for _, found in backends):
            return
        for kind in kinds:
            if kind not in self._warned and not any(kind in found.shows for _, found in backends):
                self._warned.add(kind)
                have = ", ".join(f"`{type(logger).__name__}`" for logger, _ in backends)
                rank_zero_warn(
                    f"`{self.owner}` logs {kind} to {names_showing(kind)}, and the Trainer's loggers ({have}) "
                    f"show none; {kind} are skipped (scalars still go to every logger)."
                )

    @rank_zero_only
    def log_step(self, trainer: pl.Trainer, data: StepData) -> None:
        """Send one logging step to every logger, one write each (a ``log`` call, an event, a batch)."""
        self.tags.update(dict.fromkeys(data.scalars))
        backends = self._backends(trainer)
        self._warn_unshown(backends, data.kinds())
        for logger, found in backends:
            found.write(logger, data)

    def _send(self, trainer: pl.Trainer, data: StepData) -> None:
        if self._held is None:
            self.log_step(trainer, data)
        elif data.step in self._held:
            self._held[data.step].update(data)
        else:
            self._held[data.step] = data

    @contextlib.contextmanager
    def gathered(self, trainer: pl.Trainer) -> Iterator[None]:
        """Hold every call of this sink inside the block; at its end send each step with :meth:`log_step`,
        then the layout if it was asked for. Nested blocks are one block; an exception drops what was held."""
        if self._held is not None:
            yield
            return
        held: dict[int, StepData] = {}
        self._held, self._held_layout = held, None
        try:
            yield
            layout = self._held_layout
        finally:
            self._held, self._held_layout = None, None
        for step in sorted(held):
            self.log_step(trainer, held[step])
        if layout is not None:
            self.layout(trainer, layout)

    @rank_zero_only
    def scalars(self, trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._send(trainer, StepData(step, scalars=dict(metrics)))

    @rank_zero_only
    def text(self, trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        """Markdown text: TensorBoard's Text tab, a W&B table with a row per line, ``<tag>.md`` for MLflow and CSV."""
        self._send(trainer, StepData(step, texts={tag: text}))

    @rank_zero_only
    def table(
        self, trainer: pl.Trainer, tag: str, columns: Sequence[str], rows: _Rows, step: int, caption: str = ""
    ) -> None:
        """Rows under named columns (one per module call, one per finding): a ``wandb.Table`` for W&B,
        markdown (after ``caption`` in bold) for TensorBoard, and in ``<tag>.md`` for MLflow and CSV."""
        self._send(trainer, StepData(step, tables={tag: Table(tuple(columns), tuple(map(tuple, rows)), caption)}))

    @rank_zero_only
    def flush(self, trainer: pl.Trainer) -> None:
        """Write what the loggers hold to disk now, e.g. before raising."""
        for logger, found in self._backends(trainer):
            found.flush(logger)

    @rank_zero_only
    def histograms(self, trainer: pl.Trainer, hists: dict[str, Histogram], step: int) -> None:
        """Histograms counted on device (see :func:`lightning_hooks.stats.batch.histogram`), by tag."""
        if hists:
            self._send(trainer, StepData(step, histograms=hists))

    def wants_figures(self, trainer: pl.Trainer, warn: bool = True) -> bool:
        """Whether :meth:`image` would write anywhere: on rank zero, with a logger that shows figures; without one,
        warns once when ``warn`` (figures that were asked for, not merely on by default)."""
        if not trainer.is_global_zero:
            return False
        backends = self._backends(trainer)
        if any(FIGURES in found.shows for _, found in backends):
            return True
        if warn:
            self._warn_unshown(backends, [FIGURES])
        return False

    @rank_zero_only
    def image(self, trainer: pl.Trainer, tag: str, image: NDArray[np.uint8], step: int) -> None:
        """An ``H x W x 3`` ``uint8`` image: TensorBoard's Images tab, a ``wandb.Image``, an MLflow PNG artifact."""
        self._send(trainer, StepData(step, images={tag: image}))

    @rank_zero_only
    def layout(self, trainer: pl.Trainer, step: int) -> None:
        """Write, at ``step``, the custom-scalars layout of each TensorBoard run that has tags it did not cover: one
        covering the tags of every sink that logs to the run (inside :meth:`gathered`, after the held steps)."""
        if self._held is not None:
            self._held_layout = step
            return
        for logger, found in self._backends(trainer):
            found.layout(logger, self.tags, step)
