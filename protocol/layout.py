"""Where a batch lives inside a shared-memory segment.

One segment holds a feed's whole slot pool. Slot ``i`` starts at ``i * stride`` and is laid out as::

    +-----------------------------+----------------------+-----------------------+---------+
    | images  uint8 [cap, 3, S, S] | labels int64 [cap]   | indices int64 [cap]   | padding |
    +-----------------------------+----------------------+-----------------------+---------+
    0                             labels_offset          indices_offset          stride (page aligned)

Rows ``[0, count)`` of each array are valid for a delivered batch; the rest is stale.

After the last slot, one more page starts with ``CHECK_BYTES`` random bytes the service chose and
announces (``FeedInfo.check``): a trainer that finds them there knows it mapped this service's pool
and not a segment of the same name elsewhere (another host's /dev/shm, say).
Both sides compute the layout from the same four numbers, so a descriptor on the wire needs only the
slot number, and a client can check every offset against the segment it attached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEGMENT_PREFIX = "dataferry-"
PAGE = 4096
CHECK_BYTES = 16
# Recognisable, bounded, and free of path separators: a name from the wire can never point the client
# at memory outside our own segments (see validate_segment_name).
_SEGMENT_NAME = re.compile(r"^dataferry-[A-Za-z0-9_.-]{1,200}$")


def validate_segment_name(name: str) -> str:
    """Return ``name`` if it can only denote one of our segments, else raise ValueError."""
    if not _SEGMENT_NAME.match(name) or ".." in name:
        raise ValueError(f"not a dataferry shared-memory segment name: {name!r}")
    return name


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot holding up to ``capacity`` images of ``3 x size x size`` uint8."""

    capacity: int
    size: int
    channels: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.capacity <= 65536:
            raise ValueError(f"slot capacity must be 1..65536, got {self.capacity}")
        if not 1 <= self.size <= 8192:
            raise ValueError(f"image size must be 1..8192, got {self.size}")
        if self.channels != 3:
            raise ValueError("only 3-channel images are supported")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.size, self.size)

    @property
    def image_bytes(self) -> int:
        return self.channels * self.size * self.size

    @property
    def labels_offset(self) -> int:
        return _align(self.capacity * self.image_bytes, 64)

    @property
    def indices_offset(self) -> int:
        return self.labels_offset + 8 * self.capacity

    @property
    def stride(self) -> int:
        return _align(self.indices_offset + 8 * self.capacity, PAGE)

    def segment_bytes(self, slots: int) -> int:
        """The pool itself: every slot, and the offset of the check page after it."""
        return self.stride * slots

    def mapped_bytes(self, slots: int) -> int:
        """The whole segment: the pool and its check page."""
        return self.segment_bytes(slots) + PAGE

    def slot_offset(self, slot: int, slots: int) -> int:
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} outside pool of {slots}")
        return slot * self.stride
