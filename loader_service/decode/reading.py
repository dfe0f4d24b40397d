"""Read a sample's bytes in a decode worker: the image file, or a member of a tar shard, in place.

Files go through ``transforms.read_file`` (regular files only, ``--max-file-bytes``, never blocking on
a FIFO). Tar members get the same checks: the shard must be a regular file, opened non-blocking; a
member over ``--max-file-bytes`` is refused before it is read; one whose data runs past the end of
its shard is a bad sample. Shards stay open in a small LRU of descriptors, so a batch drawn from a
few shards opens each once. Every failure is a ``DecodeError`` whose text is the reason.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

from loader_service.dataset.index import DatasetIndex
from loader_service.dataset.tables import IMAGE_EXTENSIONS, SIZE_UNKNOWN, TarMembers
from loader_service.decode.transforms import DecodeError, read_file

OPEN_SHARDS = 16
"""Shard descriptors kept open per reader: enough for the shards one batch touches, few enough for
any file-descriptor limit."""


class SampleReader:
    def __init__(self, index: DatasetIndex, max_bytes: int) -> None:
        self.index = index
        self.max_bytes = max_bytes
        self._shards: OrderedDict[int, int] = OrderedDict()

    def image_bytes(self, i: int) -> bytes:
        """The raw image file, or the sample's image member (the first jpg, jpeg, png, webp, bmp)."""
        self._check_flaw(i)
        tar = self.index.tar
        if tar is None:
            return read_file(str(self.index.path(i)), self.max_bytes)
        member = tar.image_member(i)
        if member is None:
            found = ", ".join(tar.extension(m) for m in tar.members(i)) or "none"
            raise DecodeError(f"no image member ({', '.join(IMAGE_EXTENSIONS)}; members: {found})")
        return self._member_bytes(tar, i, member, image=True)

    def metadata(self, i: int) -> dict[str, Callable[[], object]]:
        """Every metadata item of sample ``i`` by name, each read when called: a list's other columns
        (csv: strings) or keys (jsonl: JSON values), a tar sample's members other than its image
        (bytes, by extension: ``json``, ``txt``, ``cls``...; an empty member is ``b""``, an empty caption
        say). A sample flawed at indexing raises DecodeError here too, so a pipeline that reads
        neither image nor bytes still skips it."""
        self._check_flaw(i)
        tar = self.index.tar
        if tar is not None:
            image = tar.image_member(i)
            return {
                tar.extension(m): partial(self._member_bytes, tar, i, m) for m in tar.members(i) if m != image
            }
        if self.index.metadata is None:
            return {}
        try:
            items = self.index.metadata.items(i)
        except (ValueError, TypeError) as exc:  # the index was written by us: only damage gets here
            raise DecodeError(f"metadata: {exc}") from None
        return {name: partial(_value, value) for name, value in items.items()}

    def close(self) -> None:
        while self._shards:
            os.close(self._shards.popitem()[1])

    def _check_flaw(self, i: int) -> None:
        flaw = self.index.flaws.get(i)
        if flaw is not None:
            raise DecodeError(flaw)

    def _member_bytes(self, tar: TarMembers, i: int, member: int, image: bool = False) -> bytes:
        """A member's bytes; an empty one is a bad sample only as its ``image``."""
        name = f"member {self.index.names.text(i)}.{tar.extension(member)}"
        size = int(tar.member_size[member])
        if size == SIZE_UNKNOWN:
            raise DecodeError(f"{name} of 4 GiB or more is over --max-file-bytes {self.max_bytes}")
        if size > self.max_bytes:
            raise DecodeError(f"{name} of {size} bytes is over --max-file-bytes {self.max_bytes}")
        if size == 0:
            if image:
                raise DecodeError(f"{name} is empty")
            return b""
        shard = int(tar.sample_shard[i])
        fd = self._shard_fd(tar, shard)
        offset = int(tar.member_offset[member])
        try:
            data = _pread_fully(fd, size, offset)
        except OSError as exc:
            raise DecodeError(f"cannot read {name}: {exc.strerror or exc}") from None
        if len(data) < size:
            raise DecodeError(
                f"{name} runs past the end of shard {tar.shards[shard]} ({len(data)} of {size} bytes)"
            )
        return data

    def _shard_fd(self, tar: TarMembers, shard: int) -> int:
        fd = self._shards.get(shard)
        if fd is not None:
            self._shards.move_to_end(shard)
            return fd
        fd = _open_shard(str(self.index.root / tar.shards[shard]))
        self._shards[shard] = fd
        if len(self._shards) > OPEN_SHARDS:
            os.close(self._shards.popitem(last=False)[1])
        return fd


def _value(value: object) -> object:
    return value


def _open_shard(path: str) -> int:
    """A descriptor of the regular file ``path``, or DecodeError; as ``read_file`` checks files."""
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


def _pread_fully(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, fewer only at the end of the file (a read may return less)."""
    parts, got = [], 0
    while got < size:
        part = os.pread(fd, size - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
