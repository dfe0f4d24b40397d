"""A zip archive's central directory, read from its end: the end record, the ZIP64 end record where
one is needed, then every entry, without reading any member's data.

NOTE [ Zip directory ]
    The central directory is the archive's own index: per member its name, flags, compression
    method, CRC-32, sizes and where its local header lies. It is read from three places only: the
    end record in the archive's last 64 KiB (it sits after a comment of up to 65,535 bytes), the
    ZIP64 end record it points to (ImageNet's 1.28 million members need ZIP64, whose counts and
    offsets do not fit 16 and 32 bits), and the directory itself, one read. Everything in it is
    the archive's word, not ours: a count, size or offset that points outside the archive, or past
    where the directory begins, refuses the archive (``DatasetError`` naming it) or makes the one
    member a flaw; it is never followed. An archive split over several disks is refused.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from loader_service.dataset.tables import DatasetError

END = b"PK\x05\x06"
END_SIZE = 22
MAX_COMMENT = 0xFFFF
LOCATOR = b"PK\x06\x07"
LOCATOR_SIZE = 20
END64 = b"PK\x06\x06"
END64_SIZE = 56
ENTRY = b"PK\x01\x02"
ENTRY_SIZE = 46
LOCAL = b"PK\x03\x04"
LOCAL_SIZE = 30
ZIP64_EXTRA = 0x0001
UTF8_NAMES = 0x800
"""Flag bit 11: the name is UTF-8; without it, code page 437 (as Python's ``zipfile`` reads it)."""
PROGRESS_EVERY = 10_000


@dataclass(frozen=True)
class Entries:
    """The central directory's entries, in its order: parallel columns, one item an entry."""

    names: list[str]
    flags: array[int]
    methods: array[int]
    crcs: array[int]
    compressed: array[int]
    sizes: array[int]
    offsets: array[int]
    headers: array[int]
    """The entry's name and extra field lengths: about what its local header adds to its 30 bytes.
    A size or offset that the archive says is in a ZIP64 field it lacks is -1 (a flaw)."""
    data_end: int
    """Where member data must end: the directory's first byte."""


def read_entries(
    fh: BinaryIO, size: int, where: str, progress: Callable[[int], None] | None = None
) -> Entries:
    """The entries of the archive ``fh`` of ``size`` bytes (``where`` names it in errors)."""
    tail_size = min(size, END_SIZE + MAX_COMMENT)
    tail = _read_at(fh, size - tail_size, tail_size)
    at = _end_record(tail, where)
    disk, disk_with_dir, _, count, dir_size, dir_offset, _ = struct.unpack_from("<HHHHIIH", tail, at + 4)
    end_at = size - tail_size + at
    if 0xFFFF in (count, disk, disk_with_dir) or 0xFFFFFFFF in (dir_size, dir_offset):
        end_at, disk, disk_with_dir, count, dir_size, dir_offset = _zip64_end(fh, end_at, where)
    if disk != 0 or disk_with_dir != 0:
        raise DatasetError(f"zip archive {where} spans several disks; join it into one file first")
    if dir_offset + dir_size > end_at:
        raise DatasetError(
            f"zip archive {where}: its central directory ({dir_size} bytes at {dir_offset}) runs past "
            f"its end record at {end_at}: truncated or not a zip archive"
        )
    if count * ENTRY_SIZE > dir_size:
        raise DatasetError(
            f"zip archive {where} claims {count} entries, more than its {dir_size}-byte central "
            "directory can hold"
        )
    directory = _read_at(fh, dir_offset, dir_size)
    return _parse(directory, count, dir_offset, where, progress)


def _read_at(fh: BinaryIO, offset: int, size: int) -> bytes:
    fh.seek(offset)
    data = fh.read(size)
    return b"" if data is None else data


def _end_record(tail: bytes, where: str) -> int:
    """Where in ``tail`` the end record begins: the last signature whose comment ends the file."""
    at = tail.rfind(END)
    while at >= 0:
        if at + END_SIZE <= len(tail):
            (comment,) = struct.unpack_from("<H", tail, at + 20)
            if at + END_SIZE + comment == len(tail):
                return at
        at = tail.rfind(END, 0, at)
    raise DatasetError(f"{where} is not a zip archive: no end of central directory record in its last 64 KiB")


def _zip64_end(fh: BinaryIO, end_at: int, where: str) -> tuple[int, int, int, int, int, int]:
    """(where the ZIP64 end record is, disk, disk of the directory, entries, directory size, offset)."""
    if end_at < LOCATOR_SIZE:
        raise DatasetError(f"zip archive {where} needs a ZIP64 end record and has none")
    locator = _read_at(fh, end_at - LOCATOR_SIZE, LOCATOR_SIZE)
    if locator[:4] != LOCATOR:
        raise DatasetError(f"zip archive {where} needs a ZIP64 end record and has no locator for one")
    _, record_at, _ = struct.unpack_from("<IQI", locator, 4)
    if record_at + END64_SIZE > end_at - LOCATOR_SIZE:
        raise DatasetError(f"zip archive {where}: its ZIP64 end record lies past its end")
    record = _read_at(fh, record_at, END64_SIZE)
    if record[:4] != END64:
        raise DatasetError(f"zip archive {where}: no ZIP64 end record at {record_at}")
    disk, disk_with_dir, _, count, dir_size, dir_offset = struct.unpack_from("<IIQQQQ", record, 16)
    return record_at, disk, disk_with_dir, count, dir_size, dir_offset


def _parse(
    directory: bytes, count: int, dir_offset: int, where: str, progress: Callable[[int], None] | None
) -> Entries:
    found = Entries([], array("H"), array("H"), array("L"), array("q"), array("q"), array("q"), array("L"),
                    dir_offset)  # fmt: skip
    pos = 0
    for k in range(count):
        if pos + ENTRY_SIZE > len(directory) or directory[pos : pos + 4] != ENTRY:
            raise DatasetError(f"zip archive {where}: entry {k} of its central directory is damaged")
        (flags, method, crc, compressed, size, name_len, extra_len, comment_len, offset) = (
            _FIELDS.unpack_from(directory, pos)
        )
        name_at, extra_at = pos + ENTRY_SIZE, pos + ENTRY_SIZE + name_len
        pos = extra_at + extra_len + comment_len
        if pos > len(directory):
            raise DatasetError(f"zip archive {where}: entry {k} of its central directory runs past its end")
        raw = directory[name_at:extra_at]
        if 0xFFFFFFFF in (compressed, size, offset):
            size, compressed, offset = _zip64_sizes(directory[extra_at : extra_at + extra_len],
                                                    size, compressed, offset)  # fmt: skip
        found.names.append(
            raw.decode("utf-8", "surrogateescape") if flags & UTF8_NAMES else raw.decode("cp437")
        )
        found.flags.append(flags)
        found.methods.append(method)
        found.crcs.append(crc)
        found.compressed.append(compressed)
        found.sizes.append(size)
        found.offsets.append(offset)
        found.headers.append(name_len + extra_len)
        if progress is not None and (k + 1) % PROGRESS_EVERY == 0:
            progress(k + 1)
    return found


_FIELDS = struct.Struct("<8xHHxxxxIIIHHH8xI")
"""An entry's flags, method, CRC-32, compressed and uncompressed sizes, name, extra and comment
lengths, and its local header's offset (skipping versions, time, date, disk and attributes)."""


def _zip64_sizes(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    """The ZIP64 extra field's values for those of the three that are 0xFFFFFFFF, in its order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        if tag == ZIP64_EXTRA:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            wanted = [size == 0xFFFFFFFF, compressed == 0xFFFFFFFF, offset == 0xFFFFFFFF]
            given = iter(values)
            size, compressed, offset = (
                next(given, -1) if want else value
                for want, value in zip(wanted, (size, compressed, offset), strict=True)
            )
            return size, compressed, offset
        pos += 4 + length
    size, compressed, offset = (-1 if v == 0xFFFFFFFF else v for v in (size, compressed, offset))
    return size, compressed, offset


def local_data_start(header: bytes) -> int | None:
    """Where a member's data begins after its local header (its first bytes in ``header``), or
    None when ``header`` holds no local header's signature or too few bytes to tell."""
    if len(header) < LOCAL_SIZE or header[:4] != LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return LOCAL_SIZE + int(name_len) + int(extra_len)
