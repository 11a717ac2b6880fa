"""Where numbers go: the Trainer's loggers, from rank zero only."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, TypeGuard

from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard.summary import custom_scalars
from torch.utils.tensorboard.summary import text as text_summary

from lightning_hooks._layout import build_layout
from lightning_hooks._stats import Histogram

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import numpy as np
    from numpy.typing import NDArray

_RUN_TAGS: weakref.WeakKeyDictionary[TensorBoardLogger, dict[str, None]] = weakref.WeakKeyDictionary()
"""Per TensorBoard run, every scalar tag a sink has put in its custom-scalars layout, in logging order."""


def _writes_events(logger: object) -> TypeGuard[TensorBoardLogger]:
    """A TensorBoardLogger with Lightning's own ``log_metrics`` and torch's ``SummaryWriter``."""
    return (
        isinstance(logger, TensorBoardLogger)
        and type(logger).log_metrics is TensorBoardLogger.log_metrics
        and hasattr(logger.experiment, "_get_file_writer")
    )


@rank_zero_only
def echo(text: str) -> None:
    """Print on global rank zero only."""
    print(text, flush=True)


class Sink:
    """Writes scalars, text and histograms to whatever loggers a Trainer has.

    Scalars go to every logger through ``log_metrics``, except that a plain ``TensorBoardLogger``
    gets all of a step's scalars as one event (its ``log_metrics`` writes one event per scalar,
    about 20 µs each: a statistics callback logs a hundred or more per logging step). Text and
    histograms go to TensorBoard loggers and are skipped, with one warning per kind, for others.
    Every write happens on
    global rank zero only (Lightning's loggers are rank-zero-only already; the TensorBoard
    writer is reached through ``experiment``, which is too).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._warned: set[str] = set()
        self.tags: dict[str, None] = {}
        """Every scalar tag this sink has logged, in order (rank zero only)."""

    def _tensorboards(self, trainer: pl.Trainer, kind: str, warn: bool = True) -> list[TensorBoardLogger]:
        boards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if warn and not boards and trainer.loggers and kind not in self._warned:
            self._warned.add(kind)
            rank_zero_warn(
                f"`{self.owner}` logs {kind} to TensorBoard only and the Trainer has no `TensorBoardLogger`; "
                f"{kind} are skipped (scalars still go to every logger)."
            )
        return boards

    @rank_zero_only
    def scalars(self, trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        self.tags.update(dict.fromkeys(metrics))
        for logger in trainer.loggers:
            if _writes_events(logger):
                # What `log_metrics` writes, prefix included, as one summary of many values.
                values = _add_prefix(metrics, logger._prefix, logger.LOGGER_JOIN_CHAR)
                summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
                logger.experiment._get_file_writer().add_summary(summary, step)
            else:
                logger.log_metrics(metrics, step=step)

    @rank_zero_only
    def text(self, trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        for board in self._tensorboards(trainer, "text"):
            writer = board.experiment
            if hasattr(writer, "_get_file_writer"):
                # `add_text` files the text under "<tag>/text_summary"; keep the tag users asked for.
                summary = text_summary(tag, text)
                summary.value[0].tag = tag
                # A scalar string, not a 1-element vector: TensorBoard renders a vector as a table of
                # cells, which would frame a markdown table inside another one.
                summary.value[0].tensor.tensor_shape.ClearField("dim")
                writer._get_file_writer().add_summary(summary, step)
            else:  # pragma: no cover - tensorboardX writer
                writer.add_text(tag, text, global_step=step)

    @rank_zero_only
    def flush(self, trainer: pl.Trainer) -> None:
        """Write what the TensorBoard loggers hold to disk now, e.g. before raising."""
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.flush()

    @rank_zero_only
    def histogram(self, trainer: pl.Trainer, tag: str, hist: Histogram, step: int) -> None:
        """A histogram counted on device (see :func:`lightning_hooks._stats.histogram`)."""
        for board in self._tensorboards(trainer, "histograms"):
            board.experiment.add_histogram_raw(
                tag,
                min=hist.min,
                max=hist.max,
                num=hist.num,
                sum=hist.sum,
                sum_squares=hist.sum_squares,
                bucket_limits=hist.bucket_limits,
                bucket_counts=hist.bucket_counts,
                global_step=step,
            )

    def wants_figures(self, trainer: pl.Trainer, warn: bool = True) -> bool:
        """Whether :meth:`image` would write anywhere: on rank zero, with a TensorBoard logger.

        Without one, warns once when ``warn`` (figures that were asked for, not merely on by default).
        """
        return trainer.is_global_zero and bool(self._tensorboards(trainer, "figures", warn=warn))

    @rank_zero_only
    def image(self, trainer: pl.Trainer, tag: str, image: NDArray[np.uint8], step: int) -> None:
        """An ``H x W x 3`` ``uint8`` image, to the Images tab."""
        for board in self._tensorboards(trainer, "figures"):
            board.experiment.add_image(tag, image, global_step=step, dataformats="HWC")

    @rank_zero_only
    def layout(self, trainer: pl.Trainer, step: int) -> None:
        """Write the custom-scalars layout of each TensorBoard run when it has tags it did not have.

        A run has one layout (TensorBoard shows the last one written), shared by every callback
        that logs to it: the layout is built from the tags of all of their sinks, and written
        again, at ``step``, whenever one of them logged a tag the layout did not cover yet. A
        layout written by other code to the same run is replaced. Loggers other than
        TensorBoard's have no such thing and are skipped without a warning.
        """
        for board in self._tensorboards(trainer, "layouts", warn=False):
            known = _RUN_TAGS.setdefault(board, {})
            if all(tag in known for tag in self.tags):
                continue
            known.update(self.tags)
            layout = build_layout(known)
            writer = board.experiment
            if layout and hasattr(writer, "_get_file_writer"):
                writer._get_file_writer().add_summary(custom_scalars(layout), step)
