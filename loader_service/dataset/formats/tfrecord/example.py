"""A ``tf.train.Example`` record's features, read from the protobuf wire format by hand: names, and
for each its kind and values (a bytes value as where it lies in the record, not a copy).

NOTE [ Example features ]
    An Example is ``features`` (field 1), a map of named ``Feature`` entries (field 1: key 1,
    value 2), each one of ``bytes_list`` (1), ``float_list`` (2) or ``int64_list`` (3), whose
    values are field 1 (numbers packed or not: both are accepted, as protobuf's own readers do).
    Everything is the record's word: every length is checked against what is left of its
    message, varints stop at ten bytes, unknown fields are skipped by their wire type, and a
    record that does not parse is a ``ValueError`` naming why, which costs that sample only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Feature:
    kind: str
    """``bytes``, ``float`` or ``int64``."""
    values: tuple[object, ...]
    """Numbers, or for ``bytes`` (offset, length) pairs within the record."""


def features(record: bytes | memoryview) -> dict[str, Feature]:
    """The named features of an Example record; ValueError if it is not one."""
    found: dict[str, Feature] = {}
    view = memoryview(record)
    for field, start, end in _fields(view, 0, len(view)):
        if field != 1 or end < 0:
            continue
        for entry, e_start, e_end in _fields(view, start, end):
            if entry != 1 or e_end < 0:
                continue
            name, feature = _entry(view, e_start, e_end)
            if name is not None and feature is not None:
                found[name] = feature
    return found


def _entry(view: memoryview, start: int, end: int) -> tuple[str | None, Feature | None]:
    name: str | None = None
    feature: Feature | None = None
    for field, f_start, f_end in _fields(view, start, end):
        if field == 1 and f_end >= 0:
            name = bytes(view[f_start:f_end]).decode("utf-8", "replace")
        elif field == 2 and f_end >= 0:
            feature = _feature(view, f_start, f_end)
    return name, feature


def _feature(view: memoryview, start: int, end: int) -> Feature | None:
    for kind, k_start, k_end in _fields(view, start, end):
        if k_end < 0 or kind not in (1, 2, 3):
            continue
        values: list[object] = []
        for field, v_start, v_end in _fields(view, k_start, k_end, keep_numbers=True):
            if field != 1:
                continue
            if kind == 1 and v_end >= 0:
                values.append((v_start, v_end - v_start))
            elif kind == 3:
                values += _varints(view, v_start, v_end) if v_end >= 0 else [v_start]
            elif kind == 2:
                if v_end >= 0:
                    values += [v for (v,) in struct.iter_unpack("<f", view[v_start:v_end])]
                else:
                    values.append(v_start)
        return Feature(("bytes", "float", "int64")[kind - 1], tuple(values))
    return None


def _fields(
    view: memoryview, start: int, end: int, keep_numbers: bool = False
) -> Iterator[tuple[int, Any, int]]:
    """(field number, start, end) of each field in ``view[start:end]``; a number's end is -1 and,
    with ``keep_numbers``, its start is its value (a signed int64 for a varint, a float for fixed32)."""
    pos = start
    while pos < end:
        key, pos = _varint(view, pos, end)
        field, wire = key >> 3, key & 7
        if wire == LENGTH:
            length, pos = _varint(view, pos, end)
            if length > end - pos:
                raise ValueError(f"a field of {length} bytes runs past its message at byte {pos}")
            yield field, pos, pos + length
            pos += length
        elif wire == VARINT:
            value, pos = _varint(view, pos, end)
            yield field, (_signed(value) if keep_numbers else 0), -1
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
            if size > end - pos:
                raise ValueError(f"a fixed field runs past its message at byte {pos}")
            number = struct.unpack_from("<d" if size == 8 else "<f", view, pos)[0]
            yield field, (number if keep_numbers else 0), -1
            pos += size
        else:
            raise ValueError(f"wire type {wire} at byte {pos} is none protobuf has")


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= end:
            raise ValueError(f"a varint runs past its message at byte {pos}")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError(f"a varint longer than ten bytes ends at byte {pos}")


def _varints(view: memoryview, start: int, end: int) -> list[int]:
    """A packed run of varints, each a signed int64."""
    out, pos = [], start
    while pos < end:
        value, pos = _varint(view, pos, end)
        out.append(_signed(value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
