"""TensorBoard event records checksummed in C (``google-crc32c``), byte for byte TensorBoard's: the one place that
reaches into its writer, left alone when not built as expected (``tests/unit/test_events.py`` fails then)."""

from __future__ import annotations

import struct
from typing import Any

import google_crc32c
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

__all__ = ["checksum_in_c"]

IN_C = google_crc32c.implementation == "c"
"""Whether ``google-crc32c`` is compiled here (without a build it falls back to pure Python)."""


def masked_crc32c(data: bytes) -> bytes:
    """The CRC-32C of ``data`` masked as TFRecord masks it, 4 bytes little-endian.

    Example::

        >>> masked_crc32c(b"123456789").hex()  # the CRC-32C check value is 0xE3069283
        'e5b08ac7'
    """
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class CRecordWriter(RecordWriter):
    """A ``RecordWriter`` whose records are byte for byte its base's: length, its CRC, the data, its CRC."""

    def write(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._writer.write(length + masked_crc32c(length) + data + masked_crc32c(data))


def checksum_in_c(writer: SummaryWriter) -> bool:
    """Make ``writer``'s event file get its CRCs from C from now on; whether it does (``False`` for an unknown
    writer or a ``google-crc32c`` without its C build, both left alone)."""
    queue: Any = getattr(writer._get_file_writer().event_writer, "_async_writer", None)
    records: Any = getattr(queue, "_writer", None)
    if type(records) is CRecordWriter:
        return True
    thread: Any = getattr(queue, "_worker", None)
    shared = type(records) is RecordWriter and getattr(thread, "_record_writer", None) is records
    if not (IN_C and shared):
        return False
    queue._writer = thread._record_writer = CRecordWriter(records._writer)  # over the same file
    return True
