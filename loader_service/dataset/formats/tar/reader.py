"""Reading a sample's members from its shard: the image, and the metadata members, each a range read."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from loader_service.dataset.format import (
    Metadata,
)
from loader_service.dataset.storage.local import Files
from loader_service.dataset.tables import IMAGE_EXTENSIONS, SIZE_UNKNOWN, StringTable, TarMembers
from protocol.pixels import DecodeError


class TarReader:
    """Members read in place, from the local disk or an object store (``storage.Files``): a member
    over ``--max-file-bytes`` is refused before it is read; one whose data runs past the end of its
    shard is a bad sample."""

    def __init__(self, files: Files, names: StringTable, tar: TarMembers, max_bytes: int) -> None:
        self.files = files
        self.names = names
        self.tar = tar
        self.max_bytes = max_bytes

    def image_bytes(self, i: int) -> bytes:
        """The sample's image member: the first jpg, jpeg, png, webp or bmp."""
        member = self.tar.image_member(i)
        if member is None:
            found = ", ".join(self.tar.extension(m) for m in self.tar.members(i)) or "none"
            raise DecodeError(f"no image member ({', '.join(IMAGE_EXTENSIONS)}; members: {found})")
        return self._member_bytes(i, member, image=True)

    def metadata(self, i: int) -> Metadata:
        """The members other than the image, as bytes by extension (``json``, ``txt``, ``cls``...);
        an empty member is ``b""``."""
        image = self.tar.image_member(i)
        members = (m for m in self.tar.members(i) if m != image)
        return {self.tar.extension(m): partial(self._member_bytes, i, m) for m in members}

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask for the image members of ``indices`` at once (NOTE [ Object store reads ])."""
        wanted = []
        for i in indices:
            member = self.tar.image_member(i)
            if member is not None and 0 < int(self.tar.member_size[member]) <= self.max_bytes:
                wanted.append(self._where(i, member))
        self.files.prefetch(wanted)

    def close(self) -> None:
        self.files.close()

    def _where(self, i: int, member: int) -> tuple[str, int, int]:
        shard = self.tar.shards[int(self.tar.sample_shard[i])]
        return shard, int(self.tar.member_offset[member]), int(self.tar.member_size[member])

    def _member_bytes(self, i: int, member: int, image: bool = False) -> bytes:
        """A member's bytes; an empty one is a bad sample only as its ``image``."""
        tar = self.tar
        name = f"member {self.names.text(i)}.{tar.extension(member)}"
        size = int(tar.member_size[member])
        if size == SIZE_UNKNOWN:
            raise DecodeError(f"{name} of 4 GiB or more is over --max-file-bytes {self.max_bytes}")
        if size > self.max_bytes:
            raise DecodeError(f"{name} of {size} bytes is over --max-file-bytes {self.max_bytes}")
        if size == 0:
            if image:
                raise DecodeError(f"{name} is empty")
            return b""
        shard, offset, _ = self._where(i, member)
        try:
            data = self.files.read_range(shard, offset, size)
        except OSError as exc:
            raise DecodeError(f"cannot read {name}: {exc.strerror or exc}") from None
        if len(data) < size:
            raise DecodeError(f"{name} runs past the end of shard {shard} ({len(data)} of {size} bytes)")
        return data
