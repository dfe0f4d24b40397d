"""The fast scan of a plain tar shard (NOTE [ Tar scan speed ]).

Plain is what WebDataset writers and ``tar`` produce for short names: ustar or GNU headers with right
checksums, names up to 100 bytes, no prefix headers (GNU long names, pax), octal sizes, no member past
the end of the shard, nothing but zeros after the end-of-archive blocks. The scan walks the chain of
headers doing per header only what finds the next one (its size), keeps the blocks, and does all the
rest (checksums, names, keys, grouping, extensions) a batch at a time with numpy. Anything not plain
raises NotPlain, and the caller scans the shard again header by header (``scan``), which handles
everything and must give the same result on a plain shard (the tests compare the two).

The batch work needs ``np.strings`` with ``slice`` (numpy 2.3, Python 3.11 or later). With an older
numpy, decided once at import (``HAS_NUMPY_STRINGS``), every shard is NotPlain: the careful scan
indexes it, the same, only slower.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from loader_service.dataset.formats.tar.headers import BLOCK, REGULAR, USTAR, ZERO_BLOCK, checksums_ok, octal
from loader_service.dataset.formats.tar.samples import MAX_LABEL_BYTES, SampleTable, is_skipped_meta
from loader_service.dataset.tables import decode_name

READ_AHEAD = 4096
"""Bytes read at a header: usually also a small member's data and the next header."""
BATCH = 8192
"""Headers grouped at once: bounds the memory a shard of any size needs (4 MiB of blocks)."""
ZERO_CHECK_CHUNK = 1 << 20

_SIMPLE_KINDS = np.array(sorted(REGULAR | set(b"123456")), dtype=np.uint8)
"""Regular files, and links, devices, folders and FIFOs, which are skipped."""
_REGULAR_KINDS = np.array(sorted(REGULAR), dtype=np.uint8)
_USTAR = np.frombuffer(USTAR, dtype=np.uint8)
_NUMPY_STRINGS = ("str_len", "rfind", "find", "startswith", "endswith", "slice")


def has_numpy_strings(numpy: object) -> bool:
    """Whether ``numpy`` has every ``np.strings`` function the batches use (``slice``: numpy 2.3)."""
    strings = getattr(numpy, "strings", None)
    return all(hasattr(strings, name) for name in _NUMPY_STRINGS)


HAS_NUMPY_STRINGS = has_numpy_strings(np)


class NotPlain(Exception):
    """The shard needs the careful scan."""


@dataclass
class _Batch:
    blocks: bytearray = field(default_factory=bytearray)
    positions: array[int] = field(default_factory=lambda: array("q"))
    sizes: array[int] = field(default_factory=lambda: array("q"))
    small: dict[int, bytes] = field(default_factory=dict)
    """Header number in the batch -> data of a member of up to MAX_LABEL_BYTES the read-ahead held."""


@dataclass
class _Carry:
    """The sample the previous batch ended in, which the next batch's first members may continue."""

    key: bytes | None = None
    extensions: set[int] = field(default_factory=set)


def scan_plain(fd: int, end: int, shard: int, table: SampleTable) -> None:
    """Add a plain shard's samples to ``table``; NotPlain (having added some, maybe) if it is not."""
    if not HAS_NUMPY_STRINGS:
        raise NotPlain
    carry = _Carry()
    for batch in _walk(fd, end):
        carry = _group(batch, fd, shard, table, carry)


def _walk(fd: int, end: int) -> Iterator[_Batch]:
    """The header chain, in batches: per header one slice, one size parse, a few appends."""
    pread = os.pread
    batch = _Batch()
    blocks, positions, sizes, small = batch.blocks, batch.positions, batch.sizes, batch.small
    buf, buf_start, buf_end = b"", 0, 0
    pos = 0
    while pos + BLOCK <= end:
        if pos < buf_start or pos + BLOCK > buf_end:
            buf = pread(fd, READ_AHEAD, pos)
            buf_start, buf_end = pos, pos + len(buf)
            if len(buf) < BLOCK:
                raise NotPlain  # the shard shrank while it was read
        at = pos - buf_start
        block = buf[at : at + BLOCK]
        if block == ZERO_BLOCK:
            if not _zeros_from(fd, pos, end):
                raise NotPlain
            pos = end
            break
        text = block[124:136].split(b"\0", 1)[0]
        try:
            # Digits only (bytes.isdigit: ASCII) before int: it would take a sign, "_" or whitespace.
            size = int(text, 8) if text.isdigit() else octal(text)
        except ValueError:
            raise NotPlain from None  # an 8 or a 9
        data = pos + BLOCK
        if size is None or data + size > end:
            raise NotPlain  # GNU base-256, a number tar does not write (damage), a member past the end
        if size <= MAX_LABEL_BYTES and data + size <= buf_end:
            small[len(positions)] = buf[at + BLOCK : at + BLOCK + size]
        blocks += block
        positions.append(pos)
        sizes.append(size)
        pos = data + (size + BLOCK - 1) // BLOCK * BLOCK
        if len(positions) == BATCH:
            yield batch
            batch = _Batch()
            blocks, positions, sizes, small = batch.blocks, batch.positions, batch.sizes, batch.small
    if pos < end and not _zeros_from(fd, pos, end):
        raise NotPlain  # a partial block at the end
    if positions:
        yield batch


def _zeros_from(fd: int, pos: int, end: int) -> bool:
    while pos < end:
        chunk = os.pread(fd, ZERO_CHECK_CHUNK, pos)
        if not chunk or chunk.strip(b"\0"):
            return False  # bytes after the end-of-archive blocks, or the shard shrank
        pos += len(chunk)
    return True


def _names(blocks: npt.NDArray[np.uint8]) -> npt.NDArray[np.bytes_]:
    """The name field of each header; NotPlain if one has bytes after a NUL (tar reads up to it)."""
    raw = blocks[:, :100]
    names = np.ascontiguousarray(raw).view("S100")[:, 0]
    nul = raw == 0
    first_nul = np.where(nul.any(axis=1), nul.argmax(axis=1), 100)
    if (np.strings.str_len(names) > first_nul).any():
        raise NotPlain
    return names


def _check_plain(blocks: npt.NDArray[np.uint8]) -> None:
    if not checksums_ok(blocks):
        raise NotPlain
    if not np.isin(blocks[:, 156], _SIMPLE_KINDS).all():
        raise NotPlain  # prefix headers (long names, pax), sparse members, unknown kinds
    if ((blocks[:, 345] != 0) & (blocks[:, 257:263] == _USTAR).all(axis=1)).any():
        raise NotPlain  # a POSIX ustar name split into prefix and name


def _group(batch: _Batch, fd: int, shard: int, table: SampleTable, carry: _Carry) -> _Carry:
    blocks = np.frombuffer(batch.blocks, dtype=np.uint8).reshape(-1, BLOCK)
    _check_plain(blocks)
    names = _names(blocks)
    base = np.strings.rfind(names, b"/") + 1
    dot = np.strings.find(names, b".", base)
    member = np.isin(blocks[:, 156], _REGULAR_KINDS) & ~np.strings.endswith(names, b"/") & (dot > base)
    for k in np.flatnonzero(member & np.strings.startswith(names, b"__")):
        member[k] = not is_skipped_meta(names[k].tobytes())
    rows = np.flatnonzero(member)
    if not len(rows):
        return carry
    names, dot = names[rows], dot[rows]
    keys = np.strings.slice(names, 0, dot)
    ids, extension = table.extension_ids, table.extension
    exts = np.array(
        [ids[e] if e in ids else extension(e) for e in np.strings.slice(names, dot + 1, None).tolist()]
    )
    new = np.empty(len(rows), dtype=bool)
    new[0] = carry.key is None or keys[0] != carry.key
    new[1:] = keys[1:] != keys[:-1]
    starts = np.flatnonzero(new)
    first_sample = len(table)
    positions, sizes = (
        np.frombuffer(batch.positions, np.int64)[rows],
        np.frombuffer(batch.sizes, np.int64)[rows],
    )
    table.extend(shard, keys[starts].tolist(), starts, positions + BLOCK, sizes, exts)
    sample_of = np.cumsum(new) - 1 + first_sample  # rows before the first start: the carried sample
    continues = not new[0]
    _labels_and_flaws(batch, fd, table, carry if continues else _Carry(), names, rows, exts, sample_of)
    kept = carry.extensions if not len(starts) else set()
    return _Carry(keys[-1].tobytes(), kept | set(exts[sample_of == sample_of[-1]].tolist()))


def _labels_and_flaws(
    batch: _Batch,
    fd: int,
    table: SampleTable,
    carried: _Carry,
    names: npt.NDArray[np.bytes_],
    rows: npt.NDArray[np.intp],
    exts: npt.NDArray[np.int64],
    sample_of: npt.NDArray[np.int64],
) -> None:
    """Labels from ``.cls`` members and flaws (an extension twice in a sample), in member order as the
    careful scan finds them. ``carried``: the extensions the first rows' sample had already."""
    label_ext = table.label_extension
    repeats = len(np.unique(sample_of * 65536 + exts)) < len(exts) or bool(
        carried.extensions & set(exts[sample_of == sample_of[0]].tolist())
    )
    if repeats:
        visit: range | npt.NDArray[np.intp] = range(len(rows))
    elif label_ext >= 0:
        visit = np.flatnonzero(exts == label_ext)
        if _plain_labels(batch, table, rows[visit], sample_of[visit]):
            return
    else:
        return
    seen: dict[int, set[int]] = {int(sample_of[0]): set(carried.extensions)}
    for k in visit:
        sample, ext, name = int(sample_of[k]), int(exts[k]), names[k].tobytes()
        if repeats:
            got = seen.setdefault(sample, set())
            if ext in got:
                table.flaw(f"two members {decode_name(name)}", sample)
            got.add(ext)
        if ext == label_ext:
            _label(batch, fd, table, sample, int(rows[k]), name)


def _plain_labels(
    batch: _Batch, table: SampleTable, rows: npt.NDArray[np.intp], samples: npt.NDArray[np.int64]
) -> bool:
    """Set the labels at once if every one is a number the read-ahead held; else False, and nothing set."""
    texts = [batch.small.get(row) for row in rows.tolist()]
    try:
        values = np.array([int(text) for text in texts], dtype=np.int64)  # type: ignore[arg-type]
    except (ValueError, TypeError, OverflowError):  # not a number, None (not held), over 64 bits
        return False
    table.set_labels(samples, values)
    return True


def _label(batch: _Batch, fd: int, table: SampleTable, sample: int, row: int, name: bytes) -> None:
    size = batch.sizes[row]
    text = batch.small.get(row)
    if size > MAX_LABEL_BYTES:
        table.flaw(f"label member {decode_name(name)} has {size} bytes; expected a number", sample)
        return
    if text is None:
        text = os.pread(fd, size, batch.positions[row] + BLOCK)
    table.set_label(sample, name, text)
