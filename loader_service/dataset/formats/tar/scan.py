"""Tar shards indexed from one scan of their headers (the format is ``source``, its reader ``reader``).

Samples are grouped as WebDataset does (``samples``). Headers are read with ``os.pread``, a few KiB
at a time, jumping over member data; the only data read is each ``.cls`` member (the label, as text).
ustar, GNU (``L`` long names, base-256 sizes) and pax (``path`` and ``size`` records) headers are
understood; sparse members are skipped (their data is not their bytes). Compressed shards are refused
by their magic bytes: members cannot be read in place in them.

NOTE [ Tar scan speed ]: a million samples are two million headers and the target is seconds, so most
shards take the fast scan (``fast``): per header, only what finds the next header is done in Python,
and the rest a batch of headers at a time with numpy. A shard it cannot take (long names, pax
headers, damage) is scanned again header by header here (``_CarefulScan``), checking each checksum.

NOTE [ Damaged tar shards ]: a damage costs samples, never the shard. A header whose checksum is wrong,
or whose numbers are not what tar writes (a negative size, say: ``headers``), is logged with shard
and offset, and the scan resumes at the next block that holds a valid ustar header. Both the sample
being grouped at the damage and the one the scan resumes in are marked flawed (a lost ``.cls`` header
would otherwise leave a sample silently unlabelled). The first header is no exception: only a file
with no valid header at all is refused, as not a tar file. A pax ``size`` that runs past the end of
the shard is such damage too (the scan resumes; it used to end there). A member whose header's own
size runs past the end of the shard (a truncated last member) is indexed, and reading it fails; a
sample without an image member is indexed, and reading it fails: both are bad samples when read,
named by ``shard:key``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from loader_service.dataset.formats.tar.fast import READ_AHEAD, NotPlain, scan_plain
from loader_service.dataset.formats.tar.headers import (
    BLOCK,
    GNU_LONG_NAME,
    HEADER,
    PAX,
    PREFIX_KINDS,
    REGULAR,
    USTAR,
    ZERO_BLOCK,
    BadHeader,
    checksum_ok,
    compression_of,
    number,
    overridden,
    padded,
    pax_records,
)
from loader_service.dataset.formats.tar.samples import (
    LABEL_EXTENSION,
    MAX_LABEL_BYTES,
    SampleTable,
    TarScan,
    split_member_name,
)
from loader_service.dataset.tables import (
    DatasetError,
    decode_name,
)

log = logging.getLogger(__name__)

RESYNC_CHUNK = 1 << 20
MAX_HEADER_DATA = 1 << 20
"""A GNU long name or pax record set larger than this is a damaged header, not a name."""
MAX_WARNINGS_PER_SHARD = 10

__all__ = ["TarScan", "scan_files", "scan_shards"]


def scan_shards(
    root: Path, shards: Sequence[str], progress: Callable[[int], None] | None = None, fast: bool = True
) -> TarScan:
    """Index the samples of ``shards`` (relative to ``root``), numbered in shard order.

    ``fast=False`` scans every shard header by header (the tests compare the two scans).
    """
    return scan_files(((name, root / name) for name in shards), tuple(shards), str(root), progress, fast)


def scan_files(
    files: Iterable[tuple[str, Path]],
    shards: tuple[str, ...],
    where: str,
    progress: Callable[[int], None] | None = None,
    fast: bool = True,
) -> TarScan:
    """Index the shards ``files`` gives, as (name, local file) in the order of ``shards``; ``where``
    names them all in messages."""
    if not shards:
        raise DatasetError(f"no tar shards at {where}")
    table = SampleTable(progress)
    for shard, (name, path) in enumerate(files):
        fd = _open_shard(path, name)
        try:
            _scan_shard(fd, shard, name, table, fast)
        except OSError as exc:
            raise DatasetError(f"shard {name}: cannot read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
    if not len(table):
        raise DatasetError(f"the shards at {where} hold no samples (members named KEY.EXTENSION)")
    return table.build(shards)


def _open_shard(path: Path, name: str) -> int:
    try:
        # stat first: opening a FIFO would block, opening a device can act on it.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise DatasetError(f"shard {name} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DatasetError(f"shard {name} does not exist ({path})") from None
    except OSError as exc:
        raise DatasetError(f"shard {name}: cannot read: {exc.strerror or exc}") from None
    if hasattr(os, "posix_fadvise"):
        # Only headers are wanted: the kernel's read-ahead would pull in the images between them.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _scan_shard(fd: int, shard: int, name: str, table: SampleTable, fast: bool) -> None:
    end = os.fstat(fd).st_size
    starts_plainly = _check_start(fd, end, name)
    mark = table.mark()
    if fast and starts_plainly:
        try:
            scan_plain(fd, end, shard, table)
            return
        except NotPlain:
            table.rollback(mark)
    scan = _CarefulScan(fd, end, shard, name, table)
    scan.run()
    table.flaw_next = ""  # damage at the end of a shard flaws nothing in the next
    for what in scan.warnings[:MAX_WARNINGS_PER_SHARD]:
        log.warning("shard %s: %s", name, what)
    if len(scan.warnings) > MAX_WARNINGS_PER_SHARD:
        log.warning("shard %s: %d more problems", name, len(scan.warnings) - MAX_WARNINGS_PER_SHARD)


def _check_start(fd: int, end: int, name: str) -> bool:
    """DatasetError unless the shard is an uncompressed tar file (an empty one is: it has no samples).
    False when its first header is damaged (NOTE [ Damaged tar shards ]): the fast scan would only
    refuse it."""
    head = os.pread(fd, BLOCK, 0)
    kind = compression_of(head)
    if kind is not None:
        raise DatasetError(
            f"shard {name} is {kind}-compressed: dataferry reads members in place, so shards "
            "must be uncompressed tar (decompress it once)"
        )
    if not head.strip(b"\0") or checksum_ok(head):
        return True
    if _next_header(fd, BLOCK, end) >= end:
        raise DatasetError(f"shard {name} is not a tar file (no valid tar header in it)")
    return False


class _CarefulScan:
    """One shard, header by header, each checked, resuming after damage (NOTE [ Damaged tar shards ])."""

    def __init__(self, fd: int, end: int, shard: int, name: str, table: SampleTable) -> None:
        self.fd, self.end, self.shard, self.name, self.table = fd, end, shard, name, table
        self.warnings: list[str] = []
        self.buf = b""
        self.buf_start = 0
        self.key: bytes | None = None
        self.key_extensions: set[int] = set()

    def run(self) -> None:
        pos = 0
        long_name: bytes | None = None
        pax: dict[bytes, bytes] | None = None
        while pos + BLOCK <= self.end:
            block = self._read(pos, BLOCK)
            if block == ZERO_BLOCK:
                pos = self._after_zeros(pos)
                continue
            data = pos + BLOCK
            try:
                if not checksum_ok(block):
                    raise BadHeader
                name, size, kind = _fields(block)
                if kind in PREFIX_KINDS:
                    long_name, pax = self._prefix(kind, data, size, long_name, pax)
                    pos = data + padded(size)
                    continue
                name, size, regular = overridden(name, size, kind in REGULAR, long_name, pax)
                if pax and b"size" in pax and data + size > self.end:
                    raise BadHeader  # a pax size is damage past the end, not a truncated last member
            except BadHeader:
                pos = self._resync(pos)
                long_name = pax = None
                continue
            long_name = pax = None
            pos = data + padded(size)
            if regular and name[-1:] != b"/" and not self._member(name, data, size):
                return
        if pos < self.end and self._read(pos, self.end - pos).strip(b"\0"):
            self.warnings.append(f"ends inside a header at offset {pos} (truncated?)")

    def _member(self, name: bytes, offset: int, size: int) -> bool:
        """Index one regular member; False when its data runs past the end of the shard."""
        split = split_member_name(name)
        truncated = offset + size > self.end
        if split is not None:
            key, raw_ext = split
            if key != self.key:
                self.key, self.key_extensions = key, set()
                self.table.start_sample(self.shard, key)
            ext = self.table.extension(raw_ext)
            self.table.add_member(offset, size, ext)
            if ext in self.key_extensions:
                self.table.flaw(f"two members {decode_name(name)}")
            self.key_extensions.add(ext)
            if self.table.extensions[ext] == LABEL_EXTENSION:
                self._label(name, offset, size, truncated)
        if truncated:
            self.warnings.append(
                f"member {decode_name(name)} at offset {offset - BLOCK} runs past the end of the shard "
                f"({size} bytes from offset {offset}; the shard has {self.end}): truncated?"
            )
        return not truncated

    def _label(self, name: bytes, offset: int, size: int, truncated: bool) -> None:
        if truncated:
            self.table.flaw(f"label member {decode_name(name)} runs past the end of the shard")
        elif size > MAX_LABEL_BYTES:
            self.table.flaw(f"label member {decode_name(name)} has {size} bytes; expected a number")
        else:
            self.table.set_label(len(self.table) - 1, name, self._read(offset, size))

    def _prefix(
        self, kind: int, data: int, size: int, long_name: bytes | None, pax: dict[bytes, bytes] | None
    ) -> tuple[bytes | None, dict[bytes, bytes] | None]:
        """The long name or pax records a prefix header gives the next member."""
        if kind not in (GNU_LONG_NAME, PAX):
            return long_name, pax  # a long link name or pax globals: nothing a sample needs
        if size > MAX_HEADER_DATA or data + size > self.end:
            raise BadHeader
        text = self._read(data, size)
        if kind == GNU_LONG_NAME:
            return text.split(b"\0", 1)[0], pax
        return long_name, pax_records(text)

    def _read(self, pos: int, n: int) -> bytes:
        """``n`` bytes at ``pos`` (fewer at the end of the shard), through a small read-ahead window."""
        start = pos - self.buf_start
        if start < 0 or start + n > len(self.buf):
            self.buf = os.pread(self.fd, max(n, READ_AHEAD), pos)
            self.buf_start, start = pos, 0
        return self.buf[start : start + n]

    def _resync(self, pos: int) -> int:
        """The offset of the next valid ustar header after the damaged one at ``pos``, or the end."""
        found = _next_header(self.fd, pos + BLOCK, self.end)
        self.table.damage(f"tar header damaged at offset {pos} of {self.name}", self.key is not None)
        self.warnings.append(f"damaged tar header at offset {pos}; resumed at offset {found}")
        return found

    def _after_zeros(self, pos: int) -> int:
        """Where to read on after the zero block at ``pos``: the end of the shard, the next archive of
        concatenated ones (two or more zero blocks, then a header), or the next header after a zeroed
        one, which is damage (NOTE [ Damaged tar shards ])."""
        scan = pos
        while scan < self.end:
            chunk = os.pread(self.fd, RESYNC_CHUNK, scan)
            if not chunk:
                break
            rest = chunk.lstrip(b"\0")
            if not rest:
                scan += len(chunk)
                continue
            nonzero = scan + len(chunk) - len(rest)
            block = nonzero - nonzero % BLOCK
            if block - pos >= 2 * BLOCK and checksum_ok(os.pread(self.fd, BLOCK, block)):
                self.warnings.append(f"another archive follows the end of one at offset {pos}; read on")
                return block
            found = _next_header(self.fd, block, self.end)
            if found < self.end:
                self.table.damage(f"zero blocks at offset {pos} of {self.name}", self.key is not None)
                self.warnings.append(f"zero blocks at offset {pos}: damaged? read on at offset {found}")
            else:
                self.warnings.append(f"bytes after the end-of-archive blocks at {pos} are not tar members")
            return found
        return self.end


def _next_header(fd: int, pos: int, end: int) -> int:
    """The first block at or after ``pos`` (a block boundary) holding a valid ustar header, or ``end``."""
    while pos < end:
        chunk = os.pread(fd, RESYNC_CHUNK + BLOCK, pos)
        at = chunk.find(USTAR[:5], 257)
        while 0 <= at < RESYNC_CHUNK + 257:
            start = at - 257
            if start % BLOCK == 0 and checksum_ok(chunk[start : start + BLOCK]):
                return pos + start
            at = chunk.find(USTAR[:5], at + 1)
        pos += RESYNC_CHUNK
    return end


def _fields(block: bytes) -> tuple[bytes, int, int]:
    """(name, size, type flag) of a header block whose checksum is right."""
    name, size_field, _, kind, magic, prefix = HEADER.unpack(block[: HEADER.size])
    cut = name.find(0)
    if cut >= 0:
        name = name[:cut]
    if prefix[0] and magic == USTAR:  # POSIX ustar splits long names; GNU uses the field for times
        name = prefix.split(b"\0", 1)[0] + b"/" + name
    return name, number(size_field), kind
