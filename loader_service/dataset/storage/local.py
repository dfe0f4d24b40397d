"""Local storage: the bytes of a file, or of a range of one, read without trusting what is there.

The layer below the data formats (``dataset.formats``): a format says which file and which bytes
hold a sample, this module reads them (``dataset.storage.files.open_files`` picks it or a store's). Only
regular files are read: a FIFO would block a read until ``--task-timeout`` kills the worker, a link
to /dev/zero would read until memory runs out, and opening a device can act on it (a tape rewinds).
Every failure is a ``DecodeError`` whose text is the reason, so one unreadable file costs that
sample only.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from protocol.pixels import DecodeError

DEFAULT_MAX_FILE_BYTES = 256 * 2**20
"""``--max-file-bytes``: a larger file is a bad sample, refused before it is read."""


def read_file(path: str, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them, or DecodeError.

    Anything else in a dataset is a bad sample found without waiting: a FIFO would block the read
    until ``--task-timeout`` kills the worker, a link to /dev/zero would read until memory runs out.
    """
    try:
        # stat first: opening a device can act on it (a tape rewinds), so only files get opened.
        _check_file(os.stat(path), max_bytes)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait
        try:
            info = os.fstat(fd)
            _check_file(info, max_bytes)  # it may have been replaced since the stat
            data = _read_at_most(fd, info.st_size, max_bytes + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise DecodeError(f"cannot read: {exc.strerror or exc}") from None
    if not data:
        raise DecodeError("empty file")
    if len(data) > max_bytes:
        raise DecodeError(f"file grew over --max-file-bytes {max_bytes} while it was read")
    return data


_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _check_file(info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = _NOT_REGULAR.get(stat.S_IFMT(info.st_mode), "of an unknown type")
        raise DecodeError(f"not a regular file: {kind}")
    if info.st_size > max_bytes:
        raise DecodeError(f"file of {info.st_size} bytes is over --max-file-bytes {max_bytes}")


READ_CHUNK = 1 << 16
"""Bytes asked for by each read after the first, should a file be longer than fstat said."""


def _read_at_most(fd: int, expected: int, cap: int) -> bytes:
    """Read to the end of the file or ``cap`` bytes, whichever comes first. The first read asks for
    the size fstat gave plus one, so a file that did not change needs just that read and the empty
    one that ends it; a file that grew is read on in chunks, never past ``cap``."""
    parts = []
    total = 0
    want = expected + 1
    while total < cap:
        part = os.read(fd, min(want, cap - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
        want = READ_CHUNK
    return b"".join(parts)


def open_regular(path: str) -> int:
    """A descriptor of the regular file ``path`` (a tar shard), or DecodeError; checked as ``read_file``
    checks files."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # opening a device can act on it
            raise DecodeError(f"shard {path} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait
    except OSError as exc:
        raise DecodeError(f"cannot open shard {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # it may have been replaced since the stat
            raise DecodeError(f"shard {path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_fully(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, fewer only at the end of the file (a read may return less)."""
    parts, got = [], 0
    while got < size:
        part = os.pread(fd, size - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


Want = tuple[str, int, int]
"""A read a reader will make: (name, offset, size), size -1 for the whole file."""


class Files(Protocol):
    """Where a format's files are: the local disk (``LocalFiles``) or an object store
    (``objectfiles.ObjectFiles``). Names are relative to the data's root; failures are ``DecodeError``s
    (or OSErrors, from ``read_range``) that cost the sample only."""

    def read(self, name: str, max_bytes: int) -> bytes:
        """The whole file, refused over ``max_bytes``."""
        ...

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset``; fewer only where the file ends first."""
        ...

    def prefetch(self, wanted: Sequence[Want]) -> None:
        """Reads about to be made, all issued at once where that saves waiting (NOTE [ Object store
        reads ]); the data is held until the next call."""
        ...

    def is_local(self, name: str) -> bool:
        """Whether reading ``name`` costs a local read, not a request to a store."""
        ...

    def close(self) -> None: ...


class LocalFiles:
    """Files under ``root`` on this host. A file read by ranges (a tar shard) stays open in a small
    LRU of descriptors, so a batch drawn from a few shards opens each once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: OrderedDict[str, int] = OrderedDict()

    def read(self, name: str, max_bytes: int) -> bytes:
        return read_file(str(self.root / name), max_bytes)

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        return pread_fully(self._fd(name), size, offset)

    def prefetch(self, wanted: Sequence[Want]) -> None:
        pass  # the page cache and the kernel's read-ahead do this better for a local disk

    def is_local(self, name: str) -> bool:
        return True

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])

    def _fd(self, name: str) -> int:
        fd = self._open.get(name)
        if fd is not None:
            self._open.move_to_end(name)
            return fd
        fd = open_regular(str(self.root / name))
        self._open[name] = fd
        if len(self._open) > OPEN_FILES:
            os.close(self._open.popitem(last=False)[1])
        return fd


OPEN_FILES = 16
"""Descriptors a reader keeps open: enough for the shards one batch touches, few enough for any
file-descriptor limit."""
