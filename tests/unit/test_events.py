"""Event records checksummed in C are byte for byte TensorBoard's own, and only our logger's writer changes."""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

from lightning_hooks import ActivationStats, GradStats, ShapeLogger
from lightning_hooks.sinks.events import (
    CRecordWriter,
    HistogramSummaries,
    ScalarSummaries,
    checksum_in_c,
    event_bytes,
    write_summary,
)
from lightning_hooks.stats.histogram import Histogram
from tests.support.helpers import Probe, TinyNet, make_trainer

pytest.importorskip("google_crc32c", reason="the C CRC-32C comes from google-crc32c")


def records(path: Path) -> list[bytes]:
    """The data of every record in an event file (length, its CRC, data, its CRC)."""
    raw, found, at = path.read_bytes(), [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<Q", raw, at)
        found.append(raw[at + 12 : at + 12 + length])
        at += 12 + length + 4
    assert at == len(raw)
    return found


def record_writer(writer: SummaryWriter) -> RecordWriter:
    return writer._get_file_writer().event_writer._async_writer._writer


def user_writes(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> type:
    """What the user of the logger does during the fit: write through it too; which record writer it has."""
    writer = trainer.logger.experiment  # type: ignore[union-attr]
    writer.add_scalar("user/value", 1.5, trainer.global_step)
    return type(record_writer(writer))


def test_event_file_is_what_tensorboards_writer_writes(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    user = Probe("on_train_batch_end", user_writes)
    callbacks = [
        ShapeLogger(),
        GradStats(log_every_n_steps=1, histograms=True),
        ActivationStats(log_every_n_steps=1, histograms=True),  # a ReLU's histogram has a minimum of 0
    ]
    make_trainer(tmp_path, [*callbacks, user], logger=logger, max_steps=4).fit(TinyNet())
    assert user.seen == [CRecordWriter] * 4  # the C checksums were in use from the first logging step on

    [path] = Path(logger.log_dir).glob("events.out.tfevents.*")
    data = records(path)
    assert len(data) > 10
    expected = io.BytesIO()
    python_writer = RecordWriter(expected)  # TensorBoard's own, pure-Python CRC-32C
    for record in data:
        python_writer.write(record)
    assert path.read_bytes() == expected.getvalue()
    # Each event written from bytes is what serialising its message gives (what `add_event` would write).
    assert all(Event.FromString(record).SerializeToString() == record for record in data)

    events = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}).Reload()
    assert events.Scalars("grad_norm/fc1.weight")[-1].step == 3
    assert events.Histograms("grad/fc1.weight")
    assert events.Histograms("act/act")[-1].histogram_value.min == 0.0
    assert events.Tensors("shapes/train")
    assert [e.value for e in events.Scalars("user/value")] == [1.5] * 4


def test_only_the_writer_we_write_through_changes(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    other = SummaryWriter(tmp_path / "other")  # the user's own writer, in the same process
    ours = Probe("on_train_end", lambda trainer, pl_module: record_writer(trainer.logger.experiment))
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1), ours], logger=logger, max_steps=2).fit(TinyNet())
    assert type(ours.seen[0]) is CRecordWriter
    assert type(record_writer(other)) is RecordWriter
    assert isinstance(ours.seen[0], RecordWriter)
    assert checksum_in_c(object()) is False  # a writer of another make is left alone
    other.close()


# float32's extremes and rounding: beyond its range, just above its largest value, subnormal, flushed to zero
AWKWARD = [0.0, -0.0, 1.5, -2.25e-3, 1 / 3, 1e39, -1e39, 3.4028235677973366e38, 1e-40, 1e-50, math.inf, -math.inf]


@pytest.mark.parametrize("nan", [math.nan, -math.nan])
def test_scalar_summaries_are_byte_for_byte_the_messages_setting_the_fields_gives(nan: float) -> None:
    values = [*AWKWARD, nan]
    # a tag of over 127 bytes has a two-byte length, and so has its value
    tags = ["loss", "grad_norm/" + "layers.0." * 15 + "weight", "act_mean/ünïcode", *(f"t{i}" for i in range(10))]
    expected = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values, strict=True)])
    summaries = ScalarSummaries(tags)
    summaries.serialised([7.0] * len(tags))  # a first step; the next one reuses the bytes
    assert summaries.serialised(values) == expected.SerializeToString()


def set_field_by_field(tag: str, hist: Histogram) -> Summary.Value:
    """The value TensorBoard's ``add_histogram_raw`` makes of a histogram, its fields set one by one."""
    histo = HistogramProto(min=hist.min, max=hist.max, num=hist.num, sum=hist.sum, sum_squares=hist.sum_squares)
    histo.bucket_limit.extend(hist.bucket_limits)
    histo.bucket.extend(hist.bucket_counts)
    return Summary.Value(tag=tag, histo=histo)


# 15 buckets: the packed fields' lengths (120 bytes) take one byte; 16 (128) two, as 64 do
@pytest.mark.parametrize("bins", [1, 15, 16, 64])
def test_histogram_summaries_are_byte_for_byte_the_messages_setting_the_fields_gives(bins: int) -> None:
    rng = np.random.default_rng(bins)
    ends = [(-1.5, 2.0), (0.0, 0.0), (-0.0, 3.0), (1e-40, 1e39), (math.inf, -math.inf), (2.0, math.nan)]
    rows = []
    for i, (lo, hi) in enumerate(ends):  # with a zero anywhere a field is left out of the set message
        counts = rng.integers(0, 3, bins).astype(float) * (i % 2)
        rows.append([lo, hi, counts.sum(), rng.normal() * (i % 3), abs(rng.normal()) * (i % 2), *counts])
    tags = ["w", "layers.0." * 15 + "weight", "act/ünïcode", "x", "y", "z"]
    expected = Summary(value=[set_field_by_field(t, Histogram(r)) for t, r in zip(tags, rows, strict=True)])
    summaries = HistogramSummaries(tags, bins)
    summaries.serialised(np.full((len(tags), 5 + bins), 7.0))  # a first step; the next one reuses the bytes
    assert summaries.serialised(np.array(rows)) == expected.SerializeToString()


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300, 2**40, -1])
@pytest.mark.parametrize("wall_time", [0.0, -0.0, 1.5, 1_764_000_000.123])
def test_event_bytes_are_the_serialised_event(step: int, wall_time: float) -> None:
    summary = Summary(value=[Summary.Value(tag="loss", simple_value=0.5)])
    expected = Event(wall_time=wall_time, step=step, summary=summary).SerializeToString()
    assert event_bytes(summary.SerializeToString(), step, wall_time) == expected


class OwnFileWriter(FileWriter):
    """A file writer of another make: it gets the event message through its `add_event`."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.added: list[Event] = []

    def add_event(self, event: Event, step: int | None = None, walltime: float | None = None) -> None:
        self.added.append(event)
        super().add_event(event, step, walltime)


@pytest.mark.parametrize("make", [FileWriter, OwnFileWriter])
def test_a_summary_is_written_as_the_event_add_event_writes(tmp_path: Path, make: type[FileWriter]) -> None:
    summary = Summary(value=[Summary.Value(tag="loss", simple_value=0.5), Summary.Value(tag="lr", simple_value=1e-3)])
    writer = make(str(tmp_path))
    write_summary(writer, summary.SerializeToString(), 7)
    writer.close()
    if isinstance(writer, OwnFileWriter):
        assert [e.summary for e in writer.added] == [summary]
    [path] = tmp_path.glob("events.out.tfevents.*")
    events = [Event.FromString(record) for record in records(path)]
    written = events[-1]  # after the file-version event
    assert (written.step, written.summary) == (7, summary)
    assert written.wall_time > 0
