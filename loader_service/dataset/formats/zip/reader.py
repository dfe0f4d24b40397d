"""A zip sample's image: its member read by one range (local header and data together), inflated
within its stated size, and checked against its CRC-32.

NOTE [ Zip member reads ]
    Each read is one ``pread`` or one ranged GET at the offset the index holds, never a shared
    ``ZipFile`` (whose file position, shared by forked workers, gives "Bad CRC-32" errors). The
    local header's name and extra lengths may differ from the directory's, so the range covers the
    directory's lengths plus ``LOCAL_SLACK`` bytes; a local header longer still costs a second
    read. A member is refused before it is read when either size is over ``--max-file-bytes``, and
    its inflated bytes are capped at its stated size, so a member that inflates past what it
    claims (a zip bomb) is a bad sample, not a full memory. A mismatched CRC-32, a missing local
    header or data past the archive's end are bad samples, named by member.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from loader_service.dataset.format import Metadata
from loader_service.dataset.formats.zip.central import LOCAL_SIZE, local_data_start
from loader_service.dataset.formats.zip.members import ZipMembers
from loader_service.dataset.formats.zip.tree import DEFLATED, STORED
from loader_service.dataset.storage.local import Files
from loader_service.dataset.tables import StringTable
from protocol.pixels import DecodeError

LOCAL_SLACK = 64
"""Bytes read beyond the directory's name and extra lengths, for a local header's longer extra
field (Info-ZIP's timestamps are 9 to 13 bytes there against 5 in the directory)."""


class ZipReader:
    """Members of one archive, read in place from the local disk or an object store."""

    def __init__(self, files: Files, names: StringTable, zipped: ZipMembers, max_bytes: int) -> None:
        self.files = files
        self.names = names
        self.zipped = zipped
        self.max_bytes = max_bytes

    def image_bytes(self, i: int) -> bytes:
        z = self.zipped
        name = f"member {self.names.text(i)}"
        compressed, size = int(z.compressed[i]), int(z.size[i])
        for what, n in (("", size), ("compressed ", compressed)):
            if n > self.max_bytes:
                raise DecodeError(f"{name} of {n} {what}bytes is over --max-file-bytes {self.max_bytes}")
        offset, want = self._where(i)
        try:
            head = self.files.read_range(z.archive, offset, want)
        except OSError as exc:
            raise DecodeError(f"cannot read {name}: {exc.strerror or exc}") from None
        start = local_data_start(head)
        if start is None:
            raise DecodeError(f"{name}: no local header at offset {offset} of {z.archive}")
        data = head[start : start + compressed]
        if len(data) < compressed and len(head) == want:  # a local header longer than the slack
            data = self._read(name, offset + start, compressed)
        if len(data) < compressed:
            raise DecodeError(f"{name} runs past the end of {z.archive} ({len(data)} of {compressed} bytes)")
        image = self._expand(name, int(z.method[i]), data, size)
        if zlib.crc32(image) != int(z.crc[i]):
            raise DecodeError(f"{name}: CRC-32 mismatch (the archive is damaged)")
        return image

    def metadata(self, i: int) -> Metadata:
        return {}

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask for the members of ``indices`` at once (NOTE [ Object store reads ])."""
        z = self.zipped
        wanted = [
            (z.archive, *self._where(i))
            for i in indices
            if max(int(z.compressed[i]), int(z.size[i])) <= self.max_bytes
        ]
        self.files.prefetch(wanted)

    def close(self) -> None:
        self.files.close()

    def _where(self, i: int) -> tuple[int, int]:
        """(offset, bytes) of the range that holds sample ``i``'s local header and data."""
        z = self.zipped
        return int(z.offset[i]), LOCAL_SIZE + int(z.header[i]) + LOCAL_SLACK + int(z.compressed[i])

    def _read(self, name: str, offset: int, size: int) -> bytes:
        try:
            return self.files.read_range(self.zipped.archive, offset, size)
        except OSError as exc:
            raise DecodeError(f"cannot read {name}: {exc.strerror or exc}") from None

    @staticmethod
    def _expand(name: str, method: int, data: bytes, size: int) -> bytes:
        """The member's bytes, never more than its stated ``size`` (and exactly that many)."""
        if method == STORED:
            out = data
        elif method == DEFLATED:
            inflate = zlib.decompressobj(-zlib.MAX_WBITS)
            try:
                out = inflate.decompress(data, size + 1)
            except zlib.error as exc:
                raise DecodeError(f"{name} does not inflate: {exc}") from None
            if len(out) > size:
                raise DecodeError(f"{name} inflates past its stated {size} bytes")
            if not inflate.eof:
                raise DecodeError(f"{name}: its deflated data ends early (the archive is damaged)")
        else:  # a flaw of the index: never asked for
            raise DecodeError(f"{name} is compressed with method {method}")
        if len(out) != size:
            raise DecodeError(f"{name} holds {len(out)} bytes, not its stated {size}")
        return out
