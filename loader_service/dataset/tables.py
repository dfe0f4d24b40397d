"""The compact tables a dataset index is made of, and the error an index that cannot be built raises
(one sample's: ``protocol.pixels.DecodeError``).

A million names as Python strings cost ~100 MB per process; a ``StringTable`` holds them as one utf-8
blob plus an offsets array, which ``numpy.save`` writes and every decode worker maps read-only, so the
page cache holds one copy for all of them. ``StringTableBuilder`` appends to an ``array.array`` and a
``bytearray`` while a source is scanned: a list of a million ints would cost 36 bytes each.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp")
"""Extensions of a tar sample's image member (WebDataset's); other members are metadata."""


class DatasetError(ValueError):
    """The data cannot be indexed; the message names the file, and the line, shard or offset."""


def encode_name(text: str) -> bytes:
    # surrogateescape: a path that is not utf-8 on disk still round-trips to the same file.
    return text.encode("utf-8", "surrogateescape")


def decode_name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class StringTable:
    offsets: I64
    """``len + 1`` offsets into ``blob``; entry i is ``blob[offsets[i]:offsets[i+1]]``."""
    blob: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> bytes:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()

    def text(self, i: int) -> str:
        return decode_name(self.raw(i))

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.blob.nbytes)


def packed(values: array[int] | bytearray, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A read-only array over what a scan appended, without a copy: a million-sample index built and
    then copied would leave its first copy's memory in the service's heap."""
    arr: npt.NDArray[Any] = np.frombuffer(values, dtype=dtype)
    arr.flags.writeable = False
    return arr


def offsets_of(sizes: Sequence[int]) -> npt.NDArray[np.int64]:
    """``len(sizes) + 1`` values: where each of parts laid one after another begins, the total last."""
    return np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)


class StringTableBuilder:
    def __init__(self) -> None:
        self.blob = bytearray()
        self.offsets = array("q", [0])

    def add(self, raw: bytes) -> None:
        self.blob += raw
        self.offsets.append(len(self.blob))

    def extend(self, items: list[bytes]) -> None:
        ends = np.cumsum([len(item) for item in items], dtype=np.int64) + len(self.blob)
        self.blob += b"".join(items)
        self.offsets.extend(ends.tolist())

    def build(self) -> StringTable:
        return StringTable(
            offsets=packed(self.offsets, np.int64),
            blob=packed(self.blob, np.uint8),
        )


@dataclass(frozen=True)
class ListMetadata:
    """A list source's metadata: per sample, a csv row's other cells or a jsonl object's other keys."""

    style: str
    """``csv``: each entry is a JSON array of strings, one per column; ``jsonl``: a JSON object."""
    columns: tuple[str, ...]
    values: StringTable

    def items(self, i: int) -> dict[str, Any]:
        raw = self.values.raw(i)
        value = json.loads(raw) if raw else {}
        if self.style == "csv":
            return dict(zip(self.columns, value, strict=True))
        return dict(value)

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {"metadata_offsets": self.values.offsets, "metadata_blob": self.values.blob}

    def describe(self) -> dict[str, Any]:
        return {"metadata": {"style": self.style, "columns": list(self.columns)}}


SIZE_UNKNOWN = 2**32 - 1
"""``member_size`` of a member of 4 GiB or more: far over any ``--max-file-bytes``, so never read."""


@dataclass(frozen=True)
class TarMembers:
    """Where each member of each tar sample lies: (shard, offset, size, extension), in shard order.

    NOTE [ Tar index size ]: the per-sample cost is what limits a service holding millions of
    samples, so every column has the narrowest dtype that fits: a shard number (int32), the sample's
    first member (int64), and per member its data offset (int64), size (uint32, ``SIZE_UNKNOWN`` when
    4 GiB or more) and extension as an id into ``extensions`` (uint16). With an image and a ``.cls``
    member and a nine-character key that is about 65 bytes a sample, labels included.
    """

    shards: tuple[str, ...]
    """Shard files, relative to the index's root."""
    extensions: tuple[str, ...]
    sample_shard: npt.NDArray[np.int32]
    first_member: I64
    """``len + 1`` entries: sample i's members are ``first_member[i]:first_member[i+1]``."""
    member_offset: I64
    member_size: npt.NDArray[np.uint32]
    member_extension: npt.NDArray[np.uint16]

    def members(self, i: int) -> range:
        return range(int(self.first_member[i]), int(self.first_member[i + 1]))

    def extension(self, member: int) -> str:
        return self.extensions[int(self.member_extension[member])]

    def image_member(self, i: int) -> int | None:
        """The first member with an image extension, or None."""
        for m in self.members(i):
            if self.extension(m) in IMAGE_EXTENSIONS:
                return m
        return None

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {
            "sample_shard": self.sample_shard,
            "first_member": self.first_member,
            "member_offset": self.member_offset,
            "member_size": self.member_size,
            "member_extension": self.member_extension,
        }

    def describe(self) -> dict[str, Any]:
        return {"tar": {"shards": list(self.shards), "extensions": list(self.extensions)}}
