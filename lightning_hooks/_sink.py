"""Where numbers go: the Trainer's loggers, from rank zero only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch.utils.tensorboard.summary import text as text_summary

from lightning_hooks._stats import Histogram

if TYPE_CHECKING:
    import lightning.pytorch as pl


@rank_zero_only
def echo(text: str) -> None:
    """Print on global rank zero only."""
    print(text, flush=True)


class Sink:
    """Writes scalars, text and histograms to whatever loggers a Trainer has.

    Scalars go to every logger through ``log_metrics``; text and histograms go to TensorBoard
    loggers and are skipped, with one warning per kind, for others. Every write happens on
    global rank zero only (Lightning's loggers are rank-zero-only already; the TensorBoard
    writer is reached through ``experiment``, which is too).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._warned: set[str] = set()

    def has_logger(self, trainer: pl.Trainer) -> bool:
        return bool(trainer.loggers)

    def _tensorboards(self, trainer: pl.Trainer, kind: str) -> list[TensorBoardLogger]:
        boards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not boards and trainer.loggers and kind not in self._warned:
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
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @rank_zero_only
    def text(self, trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        for board in self._tensorboards(trainer, "text"):
            writer = board.experiment
            if hasattr(writer, "_get_file_writer"):
                # `add_text` files the text under "<tag>/text_summary"; keep the tag users asked for.
                summary = text_summary(tag, text)
                summary.value[0].tag = tag
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
