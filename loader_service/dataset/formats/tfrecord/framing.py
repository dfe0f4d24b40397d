"""TFRecord framing: ``u64 length | u32 masked CRC-32C of the length | data | u32 masked CRC-32C of
the data``, one record after another, no index.

NOTE [ TFRecord framing ]
    A file has no index, so the scan walks it record by record, each length trusted only once its
    own checksum agrees, and reads each record whole for its label (an Example holds it beside
    the image). A record whose data fails its checksum is a flaw, named ``file:record``; a header
    that fails, or a length past the file's end, loses the framing for the rest of that file: the
    records before it are kept and the rest is logged as skipped, named with its byte. A worker
    reads a record's data and checksum in one range and checks it again, so bytes that changed
    since the scan are a bad sample, never a wrong image. Common readers skip the checksums
    (TensorFlow's by default); these are checked, at 7 GB/s here (``_crc32c.c``). A GZIP or ZLIB
    file (TensorFlow's ``compression_type``) has no record to seek to and is refused by name.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from loader_service.dataset.formats.tfrecord.crc import length_checks

HEADER = 12
FOOTER = 4
NAMES = re.compile(r"(\.tfrecords?(-\d+-of-\d+)?|^[\w.]+-\d{5}-of-\d{5})$")
"""``*.tfrecord``, ``*.tfrecords``, ``*.tfrecord-00000-of-00010`` and TensorFlow's ImageNet scripts'
``train-00000-of-01024``."""
COMPRESSED = {b"\x1f\x8b": "GZIP", b"\x78\x01": "ZLIB", b"\x78\x5e": "ZLIB", b"\x78\x9c": "ZLIB",
              b"\x78\xda": "ZLIB"}  # fmt: skip


@dataclass(frozen=True)
class Record:
    number: int
    offset: int
    """Where its data begins in the file."""
    length: int


@dataclass
class Damage:
    """Where a file's framing broke: the records before it are read, the rest of the file is not."""

    at: int
    why: str


def named_as_tfrecord(name: str) -> bool:
    return NAMES.search(name.rsplit("/", 1)[-1]) is not None


def compression(head: bytes) -> str:
    """``GZIP`` or ``ZLIB`` when a file's first bytes are those of a compressed stream, else ""."""
    return COMPRESSED.get(head[:2], "") if not length_checks(head[:HEADER]) else ""


def records(fh: BinaryIO, size: int, damage: list[Damage]) -> Iterator[Record]:
    """Each record of the file ``fh`` of ``size`` bytes, its length checked against its own CRC;
    where the framing breaks, a ``Damage`` is added to ``damage`` and the walk ends."""
    pos = number = 0
    while pos < size:
        fh.seek(pos)
        header = fh.read(HEADER)
        if len(header) < HEADER:
            damage.append(Damage(pos, f"a record header is cut short at byte {pos}"))
            return
        if not length_checks(header):
            damage.append(Damage(pos, f"the length of record {number} at byte {pos} fails its checksum"))
            return
        (length,) = struct.unpack_from("<Q", header)
        if pos + HEADER + length + FOOTER > size:
            damage.append(Damage(pos, f"record {number} at byte {pos} ({length} bytes) runs past the end"))
            return
        yield Record(number, pos + HEADER, length)
        pos += HEADER + length + FOOTER
        number += 1
