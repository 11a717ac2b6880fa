"""Records checksummed in C are byte for byte TensorBoard's own, and only the writer we write through changes.

If a test here fails after a TensorBoard upgrade, TensorBoard's writer moved: ``checksum_in_c``
then changes nothing (records keep TensorBoard's pure-Python CRC) until it is fitted to the new one.
"""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

from lightning_hooks import ActivationStats, GradStats, ShapeLogger
from lightning_hooks.sinks.events import IN_C, CRecordWriter, checksum_in_c
from tests.support.helpers import Probe, TinyNet, make_trainer

pytestmark = pytest.mark.skipif(not IN_C, reason="google-crc32c has no C build here")


def records(path: Path) -> list[bytes]:
    """The data of every record in an event file (length, its CRC, data, its CRC)."""
    raw, found, at = path.read_bytes(), [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<Q", raw, at)
        found.append(raw[at + 12 : at + 12 + length])
        at += 12 + length + 4
    assert at == len(raw)
    return found


def as_tensorboard_writes(data: list[bytes]) -> bytes:
    """What TensorBoard's own ``RecordWriter`` (its pure-Python CRC-32C) writes for ``data``."""
    expected = io.BytesIO()
    python_writer = RecordWriter(expected)
    for record in data:
        python_writer.write(record)
    return expected.getvalue()


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300_000])
def test_a_record_is_byte_for_byte_what_tensorboard_writes(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = io.BytesIO()
    CRecordWriter(ours).write(data)
    assert ours.getvalue() == as_tensorboard_writes([data])


def step_summaries() -> list[Summary]:
    awkward = [0.0, -0.0, 1.5, 1 / 3, 1e39, 1e-50, math.inf, -math.inf]
    scalars = Summary(value=[Summary.Value(tag=f"s/{i}", simple_value=v) for i, v in enumerate(awkward)])
    histo = HistogramProto(min=-1.0, max=2.0, num=3, sum=1.5, sum_squares=4.5, bucket_limit=[0.5, 2.0], bucket=[1, 2])
    return [scalars, Summary(value=[Summary.Value(tag="h", histo=histo)])]


def test_tensorboards_writer_is_built_as_checksum_in_c_expects(tmp_path: Path) -> None:
    ours, theirs = SummaryWriter(tmp_path / "ours"), SummaryWriter(tmp_path / "theirs")
    # The attribute chain checksum_in_c follows: one RecordWriter shared by the queue and its thread.
    queue = ours._get_file_writer().event_writer._async_writer
    assert type(queue._writer) is RecordWriter
    assert queue._worker._record_writer is queue._writer
    assert hasattr(queue._writer, "_writer")

    assert checksum_in_c(ours) is True
    assert type(queue._writer) is CRecordWriter
    assert queue._worker._record_writer is queue._writer
    assert checksum_in_c(ours) is True  # again: nothing more to do
    for step in range(3):
        for summary in step_summaries():
            for writer in (ours, theirs):
                writer._get_file_writer().add_summary(summary, step, walltime=1.5 + step)
    ours.close()
    theirs.close()

    [path] = (tmp_path / "ours").glob("events.out.tfevents.*")
    [their_path] = (tmp_path / "theirs").glob("events.out.tfevents.*")
    data = records(path)
    assert path.read_bytes() == as_tensorboard_writes(data)
    assert data[1:] == records(their_path)[1:]  # all but the file-version event, whose wall time differs
    read = EventAccumulator(str(path)).Reload()
    assert [(e.step, e.value) for e in read.Scalars("s/2")] == [(0, 1.5), (1, 1.5), (2, 1.5)]
    assert read.Scalars("s/4")[0].value == math.inf  # beyond float32: an infinity, as TensorBoard writes it
    assert list(read.Histograms("h")[-1].histogram_value.bucket) == [1, 2]


def moved_queue(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(queue, "_writer")


def moved_thread(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue._worker, "_record_writer", RecordWriter(io.BytesIO()))


def other_record_writer(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Own(RecordWriter):
        pass

    own = Own(queue._writer._writer)
    monkeypatch.setattr(queue, "_writer", own)
    monkeypatch.setattr(queue._worker, "_record_writer", own)


@pytest.mark.parametrize("move", [moved_queue, moved_thread, other_record_writer])
def test_a_writer_built_otherwise_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, move: Any) -> None:
    writer = SummaryWriter(tmp_path)
    queue = writer._get_file_writer().event_writer._async_writer
    move(queue, monkeypatch)
    before = (getattr(queue, "_writer", None), queue._worker._record_writer)
    assert checksum_in_c(writer) is False
    assert (getattr(queue, "_writer", None), queue._worker._record_writer) == before
    monkeypatch.undo()
    writer.close()


def user_writes(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> type:
    """What the user of the logger does during the fit: write through it too; which record writer it has."""
    writer = trainer.logger.experiment  # type: ignore[union-attr]
    writer.add_scalar("user/value", 1.5, trainer.global_step)
    return type(writer._get_file_writer().event_writer._async_writer._writer)


def test_a_fits_event_file_is_what_tensorboards_writer_writes(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    other = SummaryWriter(tmp_path / "other")  # the user's own writer, in the same process
    user = Probe("on_train_batch_end", user_writes)
    callbacks = [
        ShapeLogger(),
        GradStats(log_every_n_steps=1, histograms=True),
        ActivationStats(log_every_n_steps=1, histograms=True),  # a ReLU's histogram has a minimum of 0
    ]
    make_trainer(tmp_path, [*callbacks, user], logger=logger, max_steps=4).fit(TinyNet())
    assert user.seen == [CRecordWriter] * 4  # the C checksums were in use from the first logging step on
    assert type(other._get_file_writer().event_writer._async_writer._writer) is RecordWriter
    other.close()

    [path] = Path(logger.log_dir).glob("events.out.tfevents.*")
    assert path.read_bytes() == as_tensorboard_writes(records(path))
    read = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}).Reload()
    assert [e.step for e in read.Scalars("grad_norm/fc1.weight")] == [0, 1, 2, 3]
    assert [e.step for e in read.Histograms("grad/fc1.weight")] == [0, 1, 2, 3]
    assert read.Histograms("act/act")[-1].histogram_value.min == 0.0
    assert read.Tensors("shapes/train")
    assert [e.value for e in read.Scalars("user/value")] == [1.5] * 4
