"""TensorBoard event records checksummed in C: the same bytes, without TensorBoard's pure-Python CRC-32C.

An event file is a sequence of records: the data's length (8 bytes, little-endian), a masked
CRC-32C of those 8 bytes, the data, a masked CRC-32C of the data. TensorBoard's ``RecordWriter``
computes the CRCs in Python, byte by byte (about 1,800 instructions per byte); ``google-crc32c``
computes the same CRC in C. :func:`checksum_in_c` makes one writer's records use it, and nothing
else in the process: no module of TensorBoard is patched, so a ``SummaryWriter`` this library
does not write through keeps TensorBoard's own code.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as python_crc32c
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard.writer import FileWriter


def _c_crc32c() -> Callable[[bytes], int] | None:
    """``google-crc32c``'s CRC-32C where it is compiled (it falls back to pure Python where it has no build)."""
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - a dependency; without it records stay as TensorBoard writes them
        return None
    return google_crc32c.value if google_crc32c.implementation == "c" else None


_C_CRC32C = _c_crc32c()
AVAILABLE = _C_CRC32C is not None
"""Whether records can be checksummed in C."""
_crc32c: Callable[[bytes], int] = _C_CRC32C or python_crc32c


def masked_crc32c(data: bytes) -> bytes:
    """The CRC-32C of ``data``, rotated right by 15 bits plus ``0xA282EAD8`` (TFRecord's mask), 4 bytes little-endian.

    Example::

        >>> masked_crc32c(b"123456789").hex()  # the CRC-32C check value is 0xE3069283
        'e5b08ac7'
    """
    crc = _crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class CRecordWriter(RecordWriter):
    """A ``RecordWriter`` whose records carry CRCs computed in C; byte for byte what its base writes."""

    def write(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._writer.write(length + masked_crc32c(length) + data + masked_crc32c(data))


def checksum_in_c(file_writer: Any) -> bool:
    """Make ``file_writer`` (torch's ``FileWriter``, as ``SummaryWriter._get_file_writer()`` returns) checksum in C.

    Its one ``RecordWriter``, shared by the event writer and its background thread, becomes a
    :class:`CRecordWriter` in place (the same object, so both see it, and ``isinstance`` still
    holds). Cheap to call again: a writer that already checksums in C is left alone. Returns
    whether the writer now checksums in C; ``False`` (nothing changed) without a C CRC-32C or when
    the writer is not built the way this TensorBoard builds it.
    """
    records = getattr(getattr(getattr(file_writer, "event_writer", None), "_async_writer", None), "_writer", None)
    if type(records) is CRecordWriter:
        return True
    if not AVAILABLE or type(records) is not RecordWriter:
        return False
    records.__class__ = CRecordWriter
    return True


class ScalarSummaries:
    """``Summary`` messages of one float per tag, for a fixed list of tags, made from bytes.

    Setting the ``simple_value`` of 6,000 ``Summary.Value`` messages one by one cost about 1,500
    instructions a value (callgrind, the encoder's logging step). Here the summary is serialised
    once, with zeros, and each step's values, as float32, are written over the zeros: a value's
    ``simple_value`` (field 2, fixed32) is the last field of its ``Summary.Value``, so its 4 bytes
    end the value's bytes, and the serialisation of a summary is the concatenation of its values'
    (a repeated field). The bytes are those of the message setting the fields gives: float32
    rounding, infinities and NaN alike (tested byte for byte).

    Example::

        >>> summary = Summary.FromString(ScalarSummaries(["loss", "lr"]).serialised([0.5, 1e-3]))
        >>> [(v.tag, round(v.simple_value, 6)) for v in summary.value]
        [('loss', 0.5), ('lr', 0.001)]
    """

    def __init__(self, tags: Sequence[str]) -> None:
        pieces = [Summary(value=[Summary.Value(tag=tag, simple_value=0.0)]).SerializeToString() for tag in tags]
        self.template = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        ends = np.cumsum([len(piece) for piece in pieces], dtype=np.int64)
        self.index = ((ends - 4)[:, None] + np.arange(4)).ravel()
        """The positions of the values' float32 bytes in ``template``."""
        self.size = len(tags)

    def serialised(self, values: Iterable[float]) -> bytes:
        """The serialised summary of ``values``, one per tag, in order: what ``SerializeToString`` gives for it."""
        data = self.template.copy()
        with np.errstate(over="ignore"):  # a double beyond float32's range is an infinity, as in the message
            data[self.index] = np.fromiter(values, dtype="<f4", count=self.size).view(np.uint8)
        return data.tobytes()


_HISTOGRAM_NUMBERS = ("min", "max", "num", "sum", "sum_squares")


def _histogram_record(bins: int) -> np.dtype[Any]:
    """A serialised ``HistogramProto`` of ``bins`` buckets whose fields are all non-zero, as a packed numpy record:
    each field's key byte (and, for the two packed repeated fields, the varint length after it), then its
    doubles, in field order."""
    head = len(HistogramProto(bucket=[1.0] * bins).SerializeToString()) - 8 * bins
    fields: list[tuple[Any, ...]] = []
    for name in _HISTOGRAM_NUMBERS:
        fields += [(f"{name}_key", "u1"), (name, "<f8")]
    for name in ("limits", "counts"):
        fields += [(f"{name}_key", "u1", (head,)), (name, "<f8", (bins,))]
    return np.dtype(fields)


class HistogramSummaries:
    """``Summary`` messages of one histogram per tag, for a fixed list of tags and number of buckets, made from bytes.

    Setting a ``HistogramProto`` field by field (two lists of 64 floats extended into repeated
    fields) cost about 28,000 instructions a histogram, 33 M for the 1,200 histograms of an
    encoder's logging step. A histogram whose five numbers and ``2 * bins`` doubles are all set
    serialises to the same length whatever they are: its bytes are laid out as a numpy record
    (:func:`_histogram_record`, checked against the serialisation of one histogram when made), so
    the histograms of a step are written as columns of an array of records, each put after the
    bytes of its tag. A number that is zero is left out of a serialised message: the few
    histograms with one (a ReLU's minimum) are serialised by protobuf from their record. The
    bytes are those of the message whose fields were set, byte for byte (tested).

    Example::

        >>> made = HistogramSummaries(["w"], 2).serialised(np.array([[0.0, 2.0, 3.0, 2.5, 4.25, 2.0, 1.0]]))
        >>> summary = Summary.FromString(made)
        >>> list(summary.value[0].histo.bucket_limit), list(summary.value[0].histo.bucket)
        ([1.0, 2.0], [2.0, 1.0])
    """

    def __init__(self, tags: Sequence[str], bins: int) -> None:
        self.bins = bins
        self.record = _histogram_record(bins)
        probe = HistogramProto(bucket_limit=[6.0] * bins, bucket=[7.0] * bins)
        for value, name in enumerate(_HISTOGRAM_NUMBERS, 1):
            setattr(probe, name, float(value))
        self.empty = np.frombuffer(probe.SerializeToString(), dtype=self.record).copy()
        """The keys and lengths of a record (its doubles are written over at each step)."""
        read = [float(self.empty[name][0]) for name in _HISTOGRAM_NUMBERS]
        if read != [1.0, 2.0, 3.0, 4.0, 5.0] or {*self.empty["limits"][0], *self.empty["counts"][0]} != {6.0, 7.0}:
            raise ValueError("a HistogramProto does not serialise as the record laid out for it")  # pragma: no cover
        size = self.record.itemsize
        self.tags = list(tags)
        self.heads = [Summary(value=[Summary.Value(tag=tag, histo=probe)]).SerializeToString()[:-size] for tag in tags]
        """Each tag's bytes before its histogram's: the value's key and length, the tag, the histogram's key and
        length."""

    def serialised(self, rows: NDArray[np.float64]) -> bytes:
        """The serialised summary of ``rows``, one :class:`~lightning_hooks.stats.batch.Histogram` row per tag, in order
        (``[min, max, num, sum, sum_sq, count_0 .. count_{bins-1}]``): what ``SerializeToString`` gives for it."""
        records = np.repeat(self.empty, len(rows))
        lo, hi = rows[:, 0:1], rows[:, 1:2]
        for i, name in enumerate(_HISTOGRAM_NUMBERS):
            records[name] = rows[:, i]
        with np.errstate(invalid="ignore", over="ignore"):  # infinite ends: the width is not used
            width = np.where(hi > lo, (hi - lo) / self.bins, 1e-12)
            # The right edge of each bucket, as Histogram.bucket_limits computes it one value at a time.
            records["limits"] = lo + width * np.arange(1, self.bins + 1)
        records["counts"] = rows[:, 5:]
        blob, size = memoryview(records.tobytes()), self.record.itemsize
        pieces = [self.heads[i] + blob[i * size : (i + 1) * size] for i in range(len(rows))]
        # A number that is +0.0 is left out of a serialised message (-0.0 is not): such a histogram's bytes are
        # its message's, made by protobuf from the record (a ReLU's minimum, say).
        for i in np.flatnonzero((rows[:, :5].view(np.uint64) == 0).any(axis=1)).tolist():
            histo = HistogramProto.FromString(blob[i * size : (i + 1) * size])
            pieces[i] = Summary(value=[Summary.Value(tag=self.tags[i], histo=histo)]).SerializeToString()
        return b"".join(pieces)


def event_bytes(summary: bytes, step: int, wall_time: float) -> bytes:
    """The serialised ``Event(wall_time=wall_time, step=step, summary=...)`` of a serialised ``summary``.

    Example::

        >>> from tensorboard.compat.proto.event_pb2 import Event
        >>> summary = Summary(value=[Summary.Value(tag="loss", simple_value=0.5)])
        >>> made = event_bytes(summary.SerializeToString(), 300, 1.5)
        >>> made == Event(wall_time=1.5, step=300, summary=summary).SerializeToString()
        True
    """
    wall = struct.pack("<d", wall_time)
    head = b"\t" + wall if wall != bytes(8) else b""  # a number that is +0.0 is left out
    if step:
        head += b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF)  # an int64: a negative one as its 64-bit two's complement
    return head + b"*" + _varint(len(summary)) + summary


def _varint(n: int) -> bytes:
    """``n`` (not negative) as a protobuf varint: seven bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def write_summary(file_writer: Any, summary: bytes, step: int) -> None:
    """Write a serialised ``summary`` as the event of ``step``, as ``file_writer.add_event(Event(summary=...), step)``
    would: the same bytes in the file.

    ``file_writer`` is torch's ``FileWriter`` (what ``SummaryWriter._get_file_writer()`` returns). Made
    by torch with TensorBoard's ``EventFileWriter``, it gets the event's bytes straight away, as its
    ``add_event`` would hand them to the writer thread after serialising the message (parsing the
    summary into an ``Event`` to have it serialised again cost as much as making the summary, for
    the 1,200 histograms of an encoder's step); a writer made otherwise gets the message.
    """
    events = getattr(file_writer, "event_writer", None)
    records = getattr(events, "_async_writer", None)
    if type(file_writer) is FileWriter and type(events) is EventFileWriter and records is not None:
        records.write(event_bytes(summary, step, time.time()))
    else:
        event = Event()
        event.summary.ParseFromString(summary)
        file_writer.add_event(event, step)
