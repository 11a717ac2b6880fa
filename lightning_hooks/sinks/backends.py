"""One backend per kind of Lightning logger: each writes a logging step's :class:`StepData` in the logger's native form,
through the logger object; ``wandb`` and ``mlflow`` are imported only when a Trainer has their logger."""

from __future__ import annotations

import dataclasses
import posixpath
import re
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from torch.utils.tensorboard.summary import custom_scalars
from torch.utils.tensorboard.summary import text as text_summary

from lightning_hooks.core.tables import Table
from lightning_hooks.sinks.events import checksum_in_c
from lightning_hooks.sinks.layout import build_layout
from lightning_hooks.stats.histogram import Histogram

if TYPE_CHECKING:
    from collections.abc import Iterable

    from numpy.typing import NDArray
    from torch.utils.tensorboard.writer import FileWriter

__all__ = ["Backend", "FIGURES", "StepData", "backend", "names_showing"]

HISTOGRAMS, FIGURES, TEXT, TABLES = "histograms", "figures", "text", "tables"
EXTRAS = (HISTOGRAMS, FIGURES, TEXT, TABLES)
"""What a logger may take besides scalars, in the order messages name them."""

STEP_KEY = "trainer/global_step"
"""The key Lightning's ``WandbLogger`` logs the step under and plots every other key against."""


@dataclass
class StepData:
    """What one logging step sends to the loggers, on the host: tags mapped to values."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    images: dict[str, NDArray[np.uint8]] = field(default_factory=dict)
    """``H x W x 3`` ``uint8`` pictures (the figures)."""

    def kinds(self) -> list[str]:
        """Which of :data:`EXTRAS` this step holds."""
        held = {HISTOGRAMS: self.histograms, FIGURES: self.images, TEXT: self.texts, TABLES: self.tables}
        return [kind for kind in EXTRAS if held[kind]]

    def markdown(self) -> dict[str, str]:
        """The texts and the tables (as markdown), by tag: what loggers without a table form show."""
        return {**self.texts, **{tag: table.markdown() for tag, table in self.tables.items()}}

    def update(self, other: StepData) -> None:
        """Add what ``other`` holds (a later value under the same tag wins)."""
        for part in ("scalars", "histograms", "texts", "tables", "images"):
            getattr(self, part).update(getattr(other, part))


def markdown_section(step: int, body: str) -> str:
    """One step's text or table in a markdown file that collects all of them."""
    return f"## step {step}\n\n{body}\n\n"


def _overrides_log_metrics(logger: Logger, base: type[Logger]) -> bool:
    """A subclass with its own ``log_metrics``: it must see the scalars, whatever else it gets."""
    return type(logger).log_metrics is not base.log_metrics


class Backend:
    """Writes :class:`StepData` to one logger. Holds no reference to it (it is cached per logger)."""

    name: ClassVar[str] = ""
    """How messages and the README name the logger kind; empty for a logger this library does not know."""
    shows: ClassVar[frozenset[str]] = frozenset()
    """Which of :data:`EXTRAS` it takes; every logger takes scalars."""

    def __init__(self) -> None:
        self.warned = False
        """Whether the one warning this backend may give has been given."""
        self._row: tuple[int, dict[str, float]] | None = None  # the scalars of a step, from every callback

    def write(self, logger: Any, data: StepData) -> None:
        """Scalars as one row per step for every callback together (a table-less logger such as CSV would get a
        sparse row from each): held until a later step comes, or :meth:`flush`."""
        if data.scalars:
            if self._row is not None and self._row[0] != data.step:
                self.flush(logger)
            step, row = self._row or (data.step, {})
            row.update(data.scalars)
            self._row = (step, row)

    def layout(self, logger: Any, tags: Iterable[str], step: int) -> None:
        """A run-wide chart layout over ``tags``; only TensorBoard has one."""

    def flush(self, logger: Any) -> None:
        """Hand the logger the held row, e.g. when training ends or before an exception ends the fit."""
        if self._row is not None:
            (step, row), self._row = self._row, None
            logger.log_metrics(row, step=step)


def prefixed(logger: TensorBoardLogger | WandbLogger, scalars: dict[str, float]) -> Mapping[str, Any]:
    """``scalars`` under the tags the logger's own ``log_metrics`` gives them (its ``prefix`` added)."""
    return _add_prefix(scalars, logger._prefix, logger.LOGGER_JOIN_CHAR)


def histogram_proto(hist: Histogram) -> HistogramProto:
    """The ``HistogramProto`` that ``SummaryWriter.add_histogram_raw`` makes of ``hist``'s fields.

    Example::

        >>> proto = histogram_proto(Histogram.of([0.0, 2.0, 3.0, 2.5, 4.25, 2.0, 1.0]))
        >>> proto.num, list(proto.bucket_limit), list(proto.bucket)
        (3.0, [1.0, 2.0], [2.0, 1.0])
    """
    return HistogramProto(
        min=hist.min,
        max=hist.max,
        num=hist.num,
        sum=hist.sum,
        sum_squares=hist.sum_squares,
        bucket_limit=hist.bucket_limits,
        bucket=hist.bucket_counts,
    )


def text_proto(tag: str, text: str) -> Summary:
    """What ``SummaryWriter.add_text`` writes, under ``tag`` itself and as one string, not a vector of one.

    Example::

        >>> value = text_proto("shapes/train", "| a |").value[0]
        >>> value.tag, value.tensor.string_val, len(value.tensor.tensor_shape.dim)
        ('shapes/train', [b'| a |'], 0)
    """
    summary = text_summary(tag, text)
    summary.value[0].tag = tag
    summary.value[0].tensor.tensor_shape.ClearField("dim")
    return summary


class TensorBoardBackend(Backend):
    """All of a step's scalars as one event, its histograms as another, markdown text and tables, images, and the
    custom-scalars layout."""

    name = "TensorBoard"
    shows = frozenset(EXTRAS)

    def __init__(self) -> None:
        super().__init__()
        self.layout_tags: dict[str, None] = {}
        """Every scalar tag a sink has put in this run's custom-scalars layout, in logging order."""

    @staticmethod
    def file_writer(logger: TensorBoardLogger) -> FileWriter:
        checksum_in_c(logger.experiment)
        return logger.experiment._get_file_writer()

    def write(self, logger: TensorBoardLogger, data: StepData) -> None:
        files = self.file_writer(logger)
        if data.scalars and _overrides_log_metrics(logger, TensorBoardLogger):
            logger.log_metrics(data.scalars, step=data.step)
        elif data.scalars:  # filled in place: building each Value and merging it in costs three times as much
            event = Event()
            add = event.summary.value.add
            for tag, value in prefixed(logger, data.scalars).items():
                entry = add()
                entry.tag, entry.simple_value = tag, value
            files.add_event(event, data.step)
        if data.histograms:
            histograms = [Summary.Value(tag=t, histo=histogram_proto(h)) for t, h in data.histograms.items()]
            files.add_summary(Summary(value=histograms), data.step)
        for tag, text in data.markdown().items():
            files.add_summary(text_proto(tag, text), data.step)
        for tag, image in data.images.items():
            logger.experiment.add_image(tag, image, data.step, dataformats="HWC")

    def layout(self, logger: TensorBoardLogger, tags: Iterable[str], step: int) -> None:
        new = [tag for tag in tags if tag not in self.layout_tags]
        if not new:
            return
        self.layout_tags.update(dict.fromkeys(new))
        layout = build_layout(self.layout_tags)
        if layout:
            self.file_writer(logger).add_summary(_closing_large_categories(custom_scalars(layout)), step)

    def flush(self, logger: TensorBoardLogger) -> None:
        logger.experiment.flush()


OPEN_CHARTS_MAX = 12
"""A custom-scalars category with more charts than this starts closed in TensorBoard."""


def _closing_large_categories(summary: Any) -> Any:
    """``summary`` (torch's custom-scalars summary) with every category of more than :data:`OPEN_CHARTS_MAX` charts
    closed."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    value = summary.value[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(value.tensor.string_val[0])
    for category in layout.category:
        category.closed = len(category.chart) > OPEN_CHARTS_MAX
    value.tensor.string_val[0] = layout.SerializeToString()
    return summary


class WandbBackend(Backend):
    """The whole step in one ``run.log`` call, with the step under ``trainer/global_step`` and no ``step=``,
    as Lightning's ``WandbLogger.log_metrics`` does."""

    name = "W&B"
    shows = frozenset(EXTRAS)

    def write(self, logger: WandbLogger, data: StepData) -> None:
        import wandb

        row: dict[str, Any] = {}
        if data.scalars and _overrides_log_metrics(logger, WandbLogger):
            logger.log_metrics(data.scalars, step=data.step)
        else:
            row.update(prefixed(logger, data.scalars))
        for tag, hist in data.histograms.items():
            edges = np.array([hist.min, *hist.bucket_limits])
            row[tag] = wandb.Histogram(np_histogram=(np.array(hist.bucket_counts), edges))
        for tag, text in data.texts.items():
            row[tag] = wandb.Table(columns=["text"], data=[[line.rstrip()] for line in text.splitlines()])
        for tag, table in data.tables.items():
            row[tag] = wandb.Table(columns=list(table.columns), data=[list(r) for r in table.rows])
        for tag, image in data.images.items():
            row[tag] = wandb.Image(image)
        if row:
            logger.experiment.log({**row, STEP_KEY: data.step})


def mlflow_key(tag: str) -> str:
    """The metric key MLflow takes for a tag: only letters, digits, ``_/.-`` and space, and no empty, ``.`` or
    ``..`` path segment.

    Example::

        >>> mlflow_key("act_mean/head.out.logits")
        'act_mean/head.out.logits'
        >>> mlflow_key("act_mean/dec.out.a:b/")
        'act_mean/dec.out.ab'
    """
    kept = re.sub(r"[^a-zA-Z0-9_/. -]+", "", tag)
    return "/".join(part for part in kept.split("/") if part not in ("", ".", "..")) or "_"


class MLflowBackend(Backend):
    """Metrics through ``log_metrics``; figures, histograms, text and tables as run artifacts.

    * figures: ``<tag>/step_<step>.png`` (``figures/gradient_flow/step_20.png``)
    * histograms: ``histograms/step_<step>.json``, ``{"step": ..., "histograms": {tag: {...}}}``
      with the fields of :class:`~lightning_hooks.stats.batch.Histogram`; every sink's histograms of a
      step land in that step's one file
    * text and tables: ``<tag>.md`` (``shapes/train.md``), a ``## step <step>`` section per write,
      the newest last; a resumed run's file is read back once and continued
    """

    name = "MLflow"
    shows = frozenset(EXTRAS)

    def __init__(self) -> None:
        super().__init__()
        self.documents: dict[str, list[str]] = {}
        """Artifact path of each markdown file -> its sections."""
        self.histograms: tuple[int, dict[str, dict[str, Any]]] = (-1, {})
        """The step of the last histogram file written, and what it holds."""

    def write(self, logger: MLFlowLogger, data: StepData) -> None:
        if data.scalars:
            keys = {tag: mlflow_key(tag) for tag in data.scalars}
            renamed = [f"`{tag}` → `{key}`" for tag, key in keys.items() if tag != key]
            if renamed and not self.warned:
                self.warned = True
                rank_zero_warn(
                    f"`{type(logger).__name__}`: MLflow metric keys may only hold letters, digits, `_`, `/`, `.`, `-` "
                    f"and spaces, and no empty path segment; these tags are logged to MLflow under other keys: "
                    f"{', '.join(renamed[:5])}"
                    + (f" and {len(renamed) - 5} more" if len(renamed) > 5 else "")
                    + " (warned once per logger)."
                )
            logger.log_metrics({keys[t]: v for t, v in data.scalars.items()}, step=data.step)
        if not data.kinds():
            return
        client, run_id = logger.experiment, logger.run_id
        for tag, image in data.images.items():
            client.log_image(run_id, image, artifact_file=f"{tag}/step_{data.step}.png")
        if data.histograms:
            step, held = self.histograms
            if step != data.step:
                held = {}
            held.update({tag: dataclasses.asdict(hist) for tag, hist in data.histograms.items()})
            self.histograms = (data.step, held)
            client.log_dict(run_id, {"step": data.step, "histograms": held}, f"histograms/step_{data.step}.json")
        for tag, text in data.markdown().items():
            path = f"{tag}.md"
            if path not in self.documents:
                self.documents[path] = _read_artifact(client, run_id, path)
            self.documents[path].append(markdown_section(data.step, text))
            client.log_text(run_id, "".join(self.documents[path]), path)


def _read_artifact(client: Any, run_id: str | None, path: str) -> list[str]:
    """``[text]`` of a run's text artifact, ``[]`` if the run has none at ``path``."""
    folder = posixpath.dirname(path) or None
    if not any(info.path == path for info in client.list_artifacts(run_id, folder)):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        return [Path(client.download_artifacts(run_id, path, tmp)).read_text(encoding="utf-8")]


class CSVBackend(Backend):
    """Scalars through ``log_metrics``; text and tables appended to ``<log_dir>/<tag>.md``."""

    name = "CSV"
    shows = frozenset({TEXT, TABLES})

    def write(self, logger: CSVLogger, data: StepData) -> None:
        super().write(logger, data)
        for tag, text in data.markdown().items():
            path = Path(logger.log_dir, f"{tag}.md")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as file:
                file.write(markdown_section(data.step, text))


BACKENDS: tuple[tuple[type[Logger], type[Backend]], ...] = (
    (TensorBoardLogger, TensorBoardBackend),
    (WandbLogger, WandbBackend),
    (MLFlowLogger, MLflowBackend),
    (CSVLogger, CSVBackend),
)
"""The logger kinds this library knows, subclasses included; any other gets :class:`Backend`: scalars only."""

_CACHE: weakref.WeakKeyDictionary[Logger, Backend] = weakref.WeakKeyDictionary()


def backend(logger: Logger) -> Backend:
    """The backend of ``logger``, one per logger object, shared by every sink that writes to it."""
    found = _CACHE.get(logger)
    if found is None:
        kind = next((b for cls, b in BACKENDS if isinstance(logger, cls)), Backend)
        found = _CACHE[logger] = kind()
    return found


def names_showing(kind: str) -> str:
    """``"TensorBoard, W&B and MLflow"``: the logger kinds that take ``kind``."""
    names = [b.name for _, b in BACKENDS if kind in b.shows]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
