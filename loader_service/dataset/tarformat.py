"""The bytes of tar headers: fields, checksums (one at a time and in bulk), pax records, and the
magic numbers of compressed files.

A header is one 512-byte block: name (100 bytes), ..., size (12, octal text or GNU base-256), mtime,
checksum (8: the sum of the block's bytes with this field read as spaces), type flag (1), link name,
magic (``ustar\\0`` for POSIX ustar and pax, ``ustar  \\0`` for GNU), ..., prefix (155: POSIX ustar's
first part of a long name). Member data follows, padded to whole blocks; two zero blocks end the archive.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
HEADER = struct.Struct("100s24x12s12x8sB100x6s82x155s")
"""name, size, checksum, type flag, magic, prefix: one C call instead of six slices."""

REGULAR = frozenset((0x30, 0x00, 0x37))  # '0', '\0' (old tars), '7' (contiguous file)
GNU_LONG_NAME = 0x4C  # 'L'
PAX = 0x78  # 'x'
PREFIX_KINDS = frozenset((GNU_LONG_NAME, PAX, 0x4B, 0x67))
"""Headers that describe the next one: GNU long name and long link name ('K'), pax and pax globals."""
USTAR = b"ustar\x00"

COMPRESSION_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x04\x22\x4d\x18", "lz4"),
)

_SIGNED_SUM = struct.Struct("148b8x356b")
_SPACES_SUM = 8 * 0x20
_ADLER_MOD = 65521


class BadHeader(Exception):
    """A header block that is not a valid one (checksum, number fields, pax records)."""


def compression_of(head: bytes) -> str | None:
    for magic, kind in COMPRESSION_MAGIC:
        if head.startswith(magic):
            return kind
    return None


def padded(size: int) -> int:
    """Bytes a member of ``size`` bytes takes after its header."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def number(field: bytes) -> int:
    """A numeric field: octal text, or GNU's base-256 when the first byte's high bit is set."""
    if field[0] & 0x80:
        if field[0] == 0xFF:
            raise BadHeader  # negative
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.split(b"\0", 1)[0] or b"0", 8)
    except ValueError:
        raise BadHeader from None


def checksum_ok(block: bytes) -> bool:
    """One header's checksum.

    Adler-32's low half is 1 + the sum of the bytes modulo 65521, computed in C; a false match needs
    the stored field to be valid octal and off by a multiple of 65521. The signed sums some old tars
    wrote are tried only when the unsigned one fails.
    """
    if len(block) != BLOCK:
        return False
    field = block[148:156]
    try:
        stored = int(field.split(b"\0", 1)[0], 8)
    except ValueError:
        return False
    if ((zlib.adler32(block) & 0xFFFF) - 1 - sum(field) + _SPACES_SUM - stored) % _ADLER_MOD == 0:
        return True
    signed: int = sum(_SIGNED_SUM.unpack(block))
    return signed + _SPACES_SUM == stored


def _octal_fields(fields: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64]:
    """The leading octal number of each row (after any spaces), as ``int(..., 8)`` reads a valid one."""
    digits = fields.astype(np.int64) - ord("0")
    is_digit = (digits >= 0) & (digits <= 7)
    value = np.zeros(len(fields), dtype=np.int64)
    started = np.zeros(len(fields), dtype=bool)
    ended = np.zeros(len(fields), dtype=bool)
    for j in range(fields.shape[1]):
        ended |= started & ~is_digit[:, j]
        value = np.where(is_digit[:, j] & ~ended, value * 8 + digits[:, j], value)
        started |= is_digit[:, j]
    return value


def checksums_ok(blocks: npt.NDArray[np.uint8]) -> bool:
    """Whether every row of ``blocks`` (header blocks, ``[n, 512]``) has a right checksum.

    numpy sums the rows; only the rows it disagrees on (an unusual field, a signed sum, damage) are
    checked one by one with ``checksum_ok``.
    """
    fields = blocks[:, 148:156]
    sums = blocks.sum(axis=1, dtype=np.uint32).astype(np.int64) - fields.sum(axis=1, dtype=np.int64)
    mismatched = np.flatnonzero(sums + _SPACES_SUM != _octal_fields(fields))
    return all(checksum_ok(blocks[k].tobytes()) for k in mismatched)


def pax_records(data: bytes) -> dict[bytes, bytes]:
    """``"%d %s=%s\\n"`` records, each starting with its own length."""
    records, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        record = data[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise BadHeader
        key, value = record[:-1].split(b"=", 1)
        records[key] = value
        pos += length
    return records


def overridden(
    name: bytes, size: int, regular: bool, long_name: bytes | None, pax: dict[bytes, bytes] | None
) -> tuple[bytes, int, bool]:
    """A member's name, size and regularity after a GNU long name or pax records before it."""
    if long_name is not None:
        name = long_name
    if pax:
        name = pax.get(b"path", name)
        if b"size" in pax:
            try:
                size = int(pax[b"size"])
            except ValueError:
                raise BadHeader from None
        # A sparse member's data is a map and the non-zero parts, not its bytes.
        regular = regular and not any(k.startswith(b"GNU.sparse.") for k in pax)
    return name, size, regular
