"""Tar members grouped into samples, accumulated over all shards in compact arrays.

WebDataset's grouping: a sample is a run of consecutive members of one shard sharing a key, the member
name up to the first dot of its last path component (``dir/a.seg.png``: key ``dir/a``, extension
``seg.png``); extensions are lower-cased. Members without a key (no dot, a leading dot) and
WebDataset's ``__name__`` entries belong to no sample.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from loader_service.dataset.tables import (
    I64,
    SIZE_UNKNOWN,
    DatasetError,
    StringTable,
    StringTableBuilder,
    TarMembers,
    decode_name,
    packed,
)

MAX_EXTENSIONS = 2**16 - 1
LABEL_EXTENSION = b"cls"
MAX_LABEL_BYTES = 64
_SKIPPED_META = re.compile(rb"__[^/]*__($|/)")


class TarScan(NamedTuple):
    labels: I64
    keys: StringTable
    members: TarMembers
    flaws: dict[int, str]


def split_member_name(name: bytes) -> tuple[bytes, bytes] | None:
    """(key, extension as written), or None for a member that belongs to no sample."""
    base = name.rfind(b"/") + 1
    dot = name.find(b".", base)
    if dot <= base or is_skipped_meta(name):
        return None
    return name[:dot], name[dot + 1 :]


def is_skipped_meta(name: bytes) -> bool:
    return name[:2] == b"__" and _SKIPPED_META.match(name) is not None


def parse_label(text: bytes) -> int | None:
    """The integer a ``.cls`` member holds (as text, spaces around allowed), or None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if -(2**63) <= value < 2**63 else None


class SampleTable:
    """What the scans of all shards add up to. The careful scan appends member by member
    (``start_sample``, ``add_member``); the fast one appends a batch at once (``extend``)."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.progress = progress
        self.labels = array("q")
        self.keys = StringTableBuilder()
        self.sample_shard = array("i")
        self.first_member = array("q", [0])
        self.member_offset = array("q")
        self.member_size = array("I")
        self.member_extension = array("H")
        self.extensions: list[bytes] = []
        """Lower-cased; a member's extension id is its position here."""
        self.extension_ids: dict[bytes, int] = {}
        """By the extension as written."""
        self._lower_ids: dict[bytes, int] = {}
        self.flaws: dict[int, str] = {}
        self.flaw_next = ""
        self._reported = 0

    def __len__(self) -> int:
        return len(self.labels)

    def extension(self, raw: bytes) -> int:
        ext = self.extension_ids.get(raw)
        if ext is not None:
            return ext
        lower = raw.lower()
        ext = self._lower_ids.get(lower)
        if ext is None:
            if len(self.extensions) >= MAX_EXTENSIONS:
                raise DatasetError(f"more than {MAX_EXTENSIONS} distinct member extensions in the shards")
            ext = self._lower_ids[lower] = len(self.extensions)
            self.extensions.append(lower)
        self.extension_ids[raw] = ext
        return ext

    @property
    def label_extension(self) -> int:
        return self._lower_ids.get(LABEL_EXTENSION, -1)

    def start_sample(self, shard: int, key: bytes) -> None:
        self.labels.append(-1)
        self.keys.add(key)
        self.sample_shard.append(shard)
        self.first_member.append(len(self.member_offset))
        self.report_progress()

    def add_member(self, offset: int, size: int, ext: int) -> None:
        """A member of the last sample started."""
        if self.flaw_next:
            self.flaw(self.flaw_next)
            self.flaw_next = ""
        self.member_offset.append(offset)
        self.member_size.append(min(size, SIZE_UNKNOWN))
        self.member_extension.append(ext)
        self.first_member[-1] = len(self.member_offset)

    def extend(
        self,
        shard: int,
        new_keys: list[bytes],
        starts: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        exts: npt.NDArray[np.int64],
    ) -> None:
        """A batch of members: ``starts`` are the positions in it where ``new_keys`` begin samples;
        members before the first start belong to the last sample already here."""
        first = len(self.member_offset)
        self.labels.extend([-1] * len(new_keys))
        self.keys.extend(new_keys)
        self.sample_shard.extend([shard] * len(new_keys))
        # The last entry is where the last sample ends: it moves to the end of this batch.
        del self.first_member[-1]
        self.first_member.extend((starts + first).tolist())
        self.first_member.append(first + len(offsets))
        self.member_offset.extend(offsets.tolist())
        self.member_size.extend(np.minimum(sizes, SIZE_UNKNOWN).tolist())
        self.member_extension.extend(exts.tolist())
        self.report_progress()

    def report_progress(self) -> None:
        if self.progress is None:
            return
        while self._reported + 10_000 <= len(self.labels):
            self._reported += 10_000
            self.progress(self._reported)

    def set_label(self, sample: int, name: bytes, text: bytes) -> None:
        value = parse_label(text)
        if value is None:
            self.flaw(f"label member {decode_name(name)} is not an integer: {text[:20]!r}", sample)
        else:
            self.labels[sample] = value

    def set_labels(self, samples: npt.NDArray[np.int64], values: npt.NDArray[np.int64]) -> None:
        view = np.frombuffer(self.labels, dtype=np.int64)
        view[samples] = values
        del view  # an array cannot grow while a view of its buffer exists

    def flaw(self, reason: str, sample: int = -1) -> None:
        """Mark a sample (by default the last one): it is a bad sample when read."""
        self.flaws.setdefault(sample if sample >= 0 else len(self.labels) - 1, reason)

    def damage(self, reason: str, grouping: bool) -> None:
        """Flaw the sample being grouped and the one the next member joins (NOTE [ Damaged tar shards ])."""
        if grouping:
            self.flaw(reason)
        self.flaw_next = reason

    def mark(self) -> tuple[int, ...]:
        return (*(len(a) for a in self._growing()), len(self.extensions))

    def rollback(self, mark: tuple[int, ...]) -> None:
        """Forget what was added since ``mark``."""
        for grown, length in zip(self._growing(), mark[:-1], strict=True):
            del grown[length:]
        del self.extensions[mark[-1] :]
        self.extension_ids = {raw: e for raw, e in self.extension_ids.items() if e < mark[-1]}
        self._lower_ids = {lower: e for lower, e in self._lower_ids.items() if e < mark[-1]}
        self.flaws = {i: r for i, r in self.flaws.items() if i < len(self.labels)}
        self.flaw_next = ""
        self.first_member[-1] = len(self.member_offset)
        self._reported = min(self._reported, len(self.labels) // 10_000 * 10_000)

    def _growing(self) -> tuple[Any, ...]:
        return (
            self.labels,
            self.keys.blob,
            self.keys.offsets,
            self.sample_shard,
            self.first_member,
            self.member_offset,
            self.member_size,
            self.member_extension,
        )

    def build(self, shards: tuple[str, ...]) -> TarScan:
        members = TarMembers(
            shards=shards,
            extensions=tuple(decode_name(e) for e in self.extensions),
            sample_shard=packed(self.sample_shard, np.int32),
            first_member=packed(self.first_member, np.int64),
            member_offset=packed(self.member_offset, np.int64),
            member_size=packed(self.member_size, np.uint32),
            member_extension=packed(self.member_extension, np.uint16),
        )
        return TarScan(packed(self.labels, np.int64), self.keys.build(), members, self.flaws)
