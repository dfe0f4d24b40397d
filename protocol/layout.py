"""Where a batch lives inside a shared-memory segment.

One segment holds a feed's whole slot pool. A batch is a set of named fields, each ``[capacity,
*shape]`` of one dtype (the built-in transforms give ``image`` uint8 ``3 x S x S`` and ``label``
int64; a user pipeline gives what it returns). Slot ``i`` starts at ``i * stride``::

    +----------------------+-----+----------------------+-----------------------+---------+
    | field 0 [cap, *shape] | ... | field k [cap, *shape] | indices int64 [cap]   | padding |
    +----------------------+-----+----------------------+-----------------------+---------+
    0                             offsets[k]             indices_offset          stride (page aligned)

A feed that offers encoded rows (``encoded`` bytes a row, NOTE [ Encoded rows ] in
``protocol/encoded.py``) has, after the indices, a table of ``encoded.COLUMNS`` int64 a row
(``table_offset``) and ``cap * encoded`` bytes (``bytes_offset``), each 64-byte aligned.

Every field starts on a 64-byte boundary, in the order the fields are declared. Rows ``[0, count)``
of each array are valid for a delivered batch; the rest is stale.

After the last slot, one more page starts with ``CHECK_BYTES`` random bytes the service chose and
announces (``FeedInfo.check``): a trainer that finds them there knows it mapped this service's pool
and not a segment of the same name elsewhere (another host's /dev/shm, say).
Both sides compute the layout from the same description (the capacity and the fields), so a
descriptor on the wire needs only the slot number, and a client can check every offset against the
segment it attached.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.encoded import COLUMNS

SEGMENT_PREFIX = "dataferry-"
PAGE = 4096
CHECK_BYTES = 16
# Recognisable, bounded, and free of path separators: a name from the wire can never point the client
# at memory outside our own segments (see validate_segment_name).
_SEGMENT_NAME = re.compile(r"^dataferry-[A-Za-z0-9_.-]{1,200}$")

DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
"""The dtypes a field may have: each has the same name in numpy and in torch."""
_ITEMSIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
             "float64": 8, "bool": 1}  # fmt: skip
MAX_FIELDS = 32
MAX_DIMS = 8
MAX_SLOT_BYTES = 1 << 36
"""64 GiB: far above any real batch, low enough that offsets never overflow anything."""
MAX_ENCODED = 1 << 26
"""Bytes of room for one encoded row (64 MiB): an average the byte area is sized by, not a file's cap."""
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def validate_segment_name(name: str) -> str:
    """Return ``name`` if it can only denote one of our segments, else raise ValueError."""
    if not _SEGMENT_NAME.match(name) or ".." in name:
        raise ValueError(f"not a dataferry shared-memory segment name: {name!r}")
    return name


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class FieldSpec:
    """One named field of a batch: every sample contributes one ``shape`` array of ``dtype``."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _FIELD_NAME.match(self.name):
            raise ValueError(
                f"field name {self.name!r} must be 1-64 letters, digits or underscores, not starting "
                "with a digit"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"field {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        shape = tuple(self.shape)
        if len(shape) > MAX_DIMS or not all(type(d) is int and 1 <= d <= 1 << 24 for d in shape):
            raise ValueError(
                f"field {self.name!r}: shape {shape!r} must have at most {MAX_DIMS} dimensions, "
                "each 1..16777216"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes one sample takes in this field."""
        return math.prod(self.shape) * self.itemsize

    def describe(self) -> str:
        """``image uint8[3, 224, 224]``: how errors and logs name a field."""
        return f"{self.name} {self.dtype}[{', '.join(map(str, self.shape))}]"


def describe_fields(fields: Sequence[FieldSpec]) -> str:
    """``image uint8[3, 224, 224], label int64[]``: how logs and errors name a batch's fields."""
    return ", ".join(f.describe() for f in fields)


def image_fields(size: int, channels: int = 3) -> tuple[FieldSpec, ...]:
    """The built-in transforms' batch: ``image`` uint8 ``channels x size x size``, ``label`` int64."""
    return (FieldSpec("image", "uint8", (channels, size, size)), FieldSpec("label", "int64", ()))


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot holding up to ``capacity`` samples of ``fields``."""

    capacity: int
    fields: tuple[FieldSpec, ...]
    encoded: int = 0
    """Bytes of room a row for encoded rows (NOTE [ Encoded rows ]); 0: the feed offers none."""
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Byte offset of each field within the slot, in the order of ``fields``."""
    indices_offset: int = field(init=False, repr=False, compare=False)
    table_offset: int = field(init=False, repr=False, compare=False)
    """Where the encoded rows' table starts (its size: 0 rows where ``encoded`` is 0)."""
    bytes_offset: int = field(init=False, repr=False, compare=False)
    """Where the encoded rows' bytes start."""
    stride: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.capacity <= 65536:
            raise ValueError(f"slot capacity must be 1..65536, got {self.capacity}")
        fields = tuple(self.fields)
        if not 1 <= len(fields) <= MAX_FIELDS:
            raise ValueError(f"a batch needs 1..{MAX_FIELDS} fields, got {len(fields)}")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"field names repeat: {names}")
        offsets = []
        end = 0
        for f in fields:
            offsets.append(end)
            end = _align(end + self.capacity * f.row_bytes, 64)
        if type(self.encoded) is not int or not 0 <= self.encoded <= MAX_ENCODED:
            raise ValueError(f"encoded row room must be 0..{MAX_ENCODED} bytes, got {self.encoded!r}")
        table = _align(end + 8 * self.capacity, 64)
        rows = self.capacity if self.encoded else 0
        area = _align(table + 8 * COLUMNS * rows, 64)
        stride = _align(area + self.capacity * self.encoded, PAGE)
        if stride > MAX_SLOT_BYTES:
            raise ValueError(f"a slot of {stride} bytes is over the {MAX_SLOT_BYTES}-byte limit")
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "indices_offset", end)
        object.__setattr__(self, "table_offset", table)
        object.__setattr__(self, "bytes_offset", area)
        object.__setattr__(self, "stride", stride)

    @classmethod
    def images(cls, capacity: int, size: int) -> SlotLayout:
        """The built-in transforms' layout (``image_fields``)."""
        if not 1 <= size <= 8192:
            raise ValueError(f"image size must be 1..8192, got {size}")
        return cls(capacity, image_fields(size))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def parts(self, count: int) -> list[tuple[int, int]]:
        """(offset, bytes) of the first ``count`` rows of every field, then of the indices."""
        rows = [(off, count * f.row_bytes) for f, off in zip(self.fields, self.offsets, strict=True)]
        return [*rows, (self.indices_offset, 8 * count)]

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

    def wire(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The fields as ``FeedInfo.fields`` carries them."""
        return tuple((f.name, f.dtype, f.shape) for f in self.fields)

    @property
    def encoded_area(self) -> int:
        """Bytes of a slot's encoded-row area (0 without one)."""
        return self.capacity * self.encoded

    @classmethod
    def from_wire(
        cls, capacity: int, fields: tuple[tuple[str, str, tuple[int, ...]], ...], encoded: int = 0
    ) -> SlotLayout:
        """The layout a ``FeedInfo`` describes; ValueError if it is not a valid one."""
        specs = tuple(FieldSpec(name, dtype, tuple(shape)) for name, dtype, shape in fields)
        return cls(capacity, specs, encoded)
