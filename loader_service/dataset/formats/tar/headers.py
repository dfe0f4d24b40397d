"""The bytes of tar headers: fields, checksums (one at a time and in bulk), pax records, and the
magic numbers of compressed files.

A header is one 512-byte block: name (100 bytes), ..., size (12, octal text or GNU base-256), mtime,
checksum (8: the sum of the block's bytes with this field read as spaces), type flag (1), link name,
magic (``ustar\\0`` for POSIX ustar and pax, ``ustar  \\0`` for GNU), ..., prefix (155: POSIX ustar's
first part of a long name). Member data follows, padded to whole blocks; two zero blocks end the archive.

Numbers are read as tar writes them, and nothing else is: octal digits, maybe after spaces and before
spaces, up to the first NUL (``octal``); pax lengths and sizes in decimal digits. Python's ``int``
would also take a sign, ``_`` between digits, a ``0o`` prefix and any whitespace around: a negative
size with a right checksum would move a scan backwards (NOTE [ Damaged tar shards ] in ``scan``).
"""

from __future__ import annotations

import re
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

_OCTAL_TEXT = re.compile(rb" *[0-7]+ *")
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_OCTAL_ZERO = np.uint64(0x3030303030303030)  # "0" in every byte
_OCTAL_MASK = np.uint64(0xF8F8F8F8F8F8F8F8)  # a byte is an octal digit when it is "0" under this mask
_SPACES = np.uint64(0x2020202020202020)
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


def octal(field: bytes) -> int | None:
    """A field's octal text: up to the first NUL, octal digits with spaces maybe before and after
    them; an empty one is 0. None for anything else (a sign, ``_``, other whitespace, only spaces)."""
    text = field.split(b"\0", 1)[0]
    if not text:
        return 0
    if _OCTAL_TEXT.fullmatch(text) is None:
        return None
    return int(text, 8)


def number(field: bytes) -> int:
    """A numeric field: octal text, or GNU's base-256 when the first byte's high bit is set (its next
    bit is the sign; a negative number is BadHeader, as is a field that is neither)."""
    if field[0] & 0x80:
        if field[0] & 0x40:
            raise BadHeader  # negative
        return int.from_bytes(bytes((field[0] & 0x3F,)) + field[1:], "big")
    value = octal(field)
    if value is None:
        raise BadHeader
    return value


def decimal(text: bytes) -> int:
    """A pax number: decimal digits only; BadHeader otherwise."""
    if not text.isdigit():  # bytes.isdigit: ASCII digits, and False for b""
        raise BadHeader
    return int(text)


def checksum_ok(block: bytes) -> bool:
    """One header's checksum.

    Adler-32's low half is 1 + the sum of the bytes modulo 65521, computed in C; a false match needs
    the stored field to be valid octal and off by a multiple of 65521. The signed sums some old tars
    wrote are tried only when the unsigned one fails.
    """
    if len(block) != BLOCK:
        return False
    field = block[148:156]
    stored = octal(field) if field[0] else None  # an empty field is no checksum
    if stored is None:
        return False
    if ((zlib.adler32(block) & 0xFFFF) - 1 - sum(field) + _SPACES_SUM - stored) % _ADLER_MOD == 0:
        return True
    signed: int = sum(_SIGNED_SUM.unpack(block))
    return signed + _SPACES_SUM == stored


def _zero_bytes(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """0x80 in each byte of ``words`` that is 0, and 0 in the others (exact: no carry between bytes)."""
    low: npt.NDArray[np.uint64] = ~(((words & _LOW7) + _LOW7) | words | _LOW7)
    return low


def octal_fields_ok(fields: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Which rows of ``fields`` (``[n, width]``, width up to 8: the checksum) ``octal`` reads: up to
    the first NUL, nothing, or spaces, one run of octal digits, spaces.

    Each row is one 64-bit word, each byte's class a bit (0x80) of it: a pass over the rows' bytes
    along their short axis would cost more than the rest of a batch's checks.
    """
    rows, width = fields.shape
    assert width <= 8
    padded = np.zeros((rows, 8), dtype=np.uint8)  # NUL after a shorter field: where it ends anyway
    padded[:, :width] = fields
    words = padded.view("<u8")[:, 0]
    nul = _zero_bytes(words)
    live = (((nul & (~nul + 1)) >> 7) - 1) & _HIGH  # the bytes before the first NUL (all: no NUL)
    digits = _zero_bytes((words ^ _OCTAL_ZERO) & _OCTAL_MASK) & live
    spaces = _zero_bytes(words ^ _SPACES) & live
    starts = digits & ~(digits << 8)  # the first digit of each run of digits
    one_run = (starts != 0) & ((starts & (starts - 1)) == 0)
    ok: npt.NDArray[np.bool_] = ((digits | spaces) == live) & (one_run | (live == 0))
    return ok


def _octal_fields(fields: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64]:
    """The leading octal number of each row (after any spaces): what ``octal`` reads of a row that
    ``octal_fields_ok`` accepts and that does not start with a NUL."""
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
    odd = (sums + _SPACES_SUM != _octal_fields(fields)) | ~octal_fields_ok(fields) | (fields[:, 0] == 0)
    mismatched = np.flatnonzero(odd)
    return all(checksum_ok(blocks[k].tobytes()) for k in mismatched)


def pax_records(data: bytes) -> dict[bytes, bytes]:
    """``"%d %s=%s\\n"`` records, each starting with its own length."""
    records, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        length = decimal(data[pos:space]) if space > pos else 0
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
            size = decimal(pax[b"size"])
        # A sparse member's data is a map and the non-zero parts, not its bytes.
        regular = regular and not any(k.startswith(b"GNU.sparse.") for k in pax)
    return name, size, regular
