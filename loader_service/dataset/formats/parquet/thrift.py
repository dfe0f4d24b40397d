"""A page header, parsed from the Thrift compact protocol with every size and count bounded (NOTE
[ Untrusted pages ] in ``pages``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeAlias

from loader_service.dataset.formats.parquet.pagemodel import (
    DATA_PAGE,
    DATA_PAGE_V2,
    DICTIONARY_PAGE,
    FIRST_HEADER_READ,
    INDEX_PAGE,
    MAX_DEPTH,
    MAX_HEADER,
    MAX_HEADER_VALUES,
    MAX_PAGE,
    PLAIN,
    RLE,
    PageHeader,
    ParquetPageError,
    ReadAt,
)

Fields: TypeAlias = "dict[int, int | Fields]"
"""A struct's integer, boolean (0 or 1) and struct fields by id; binary, double and container
fields are skipped: no PageHeader field this reader uses is one."""


class _Truncated(Exception):
    """The header goes on past the bytes read so far: at least ``need`` bytes are needed."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class _Compact:
    """A reader of one compact-protocol struct from ``data``."""

    def __init__(self, data: bytes | memoryview, where: str) -> None:
        self.data = data
        self.pos = 0
        self.where = where
        self.budget = MAX_HEADER_VALUES

    def fail(self, reason: str) -> ParquetPageError:
        return ParquetPageError(f"{self.where}: {reason} at byte {self.pos} of the header")

    def skip(self, size: int) -> None:
        if size > MAX_HEADER:
            raise self.fail(f"a field of {size} bytes")
        if self.pos + size > len(self.data):
            raise _Truncated(self.pos + size)
        self.pos += size

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Truncated(self.pos + 1)
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = 0
        for shift in range(0, 70, 7):
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
        raise self.fail("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def struct(self, depth: int = 0) -> Fields:
        if depth > MAX_DEPTH:
            raise self.fail(f"structs nested more than {MAX_DEPTH} deep")
        fields: Fields = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:  # STOP
                return fields
            delta, ctype = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            if ctype in (1, 2):  # a boolean field is its type: 1 true, 2 false
                fields[last] = 2 - ctype
                self.spend()
                continue
            value = self.value(ctype, depth)
            if value is not None:
                fields[last] = value

    def spend(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise self.fail(f"more than {MAX_HEADER_VALUES} values")

    def value(self, ctype: int, depth: int) -> int | Fields | None:
        """One value of compact type ``ctype``: integers and structs; None for what is skipped."""
        self.spend()
        if ctype in (1, 2):  # a boolean in a list: one byte
            self.skip(1)
            return None
        if ctype == 3:
            b = self.byte()
            return b - 256 if b > 127 else b
        if ctype in (4, 5, 6):
            return self.zigzag()
        if ctype == 7:
            self.skip(8)
            return None
        if ctype == 8:
            self.skip(self.varint())
            return None
        if ctype in (9, 10):
            self.skip_list(depth)
            return None
        if ctype == 11:
            self.skip_map(depth)
            return None
        if ctype == 12:
            return self.struct(depth + 1)
        raise self.fail(f"unknown compact type {ctype}")

    def skip_list(self, depth: int) -> None:
        head = self.byte()
        size, ctype = head >> 4, head & 0x0F
        if size == 15:
            size = self.varint()
        self.skip_items(size, (ctype,), depth)

    def skip_map(self, depth: int) -> None:
        size = self.varint()
        if size:
            types = self.byte()
            self.skip_items(size, (types >> 4, types & 0x0F), depth)

    def skip_items(self, size: int, types: tuple[int, ...], depth: int) -> None:
        # Every item takes a byte at least: more items than header bytes left cannot be right.
        if size > MAX_HEADER:
            raise self.fail(f"a container of {size} items")
        if depth >= MAX_DEPTH:
            raise self.fail(f"containers nested more than {MAX_DEPTH} deep")
        for _ in range(size):
            for ctype in types:
                self.value(ctype, depth + 1)


def _int(fields: Fields, key: int, name: str, where: str) -> int:
    value = fields.get(key)
    if not isinstance(value, int):
        raise ParquetPageError(f"{where}: no {name}")
    return value


def _struct(fields: Fields, key: int, name: str, where: str) -> Fields:
    value = fields.get(key)
    if not isinstance(value, dict):
        raise ParquetPageError(f"{where}: no {name}")
    return value


def _sized(value: int, name: str, where: str, limit: int = MAX_PAGE) -> int:
    if not 0 <= value <= limit:
        raise ParquetPageError(f"{where}: {name} {value} is outside 0..{limit}")
    return value


def page_header(fields: Fields, where: str) -> PageHeader:
    """The header of a parsed ``PageHeader`` struct, with its sizes bounded."""
    kind = _int(fields, 1, "page type", where)
    crc = fields.get(4)
    common = PageHeader(
        kind=kind,
        uncompressed_size=_sized(
            _int(fields, 2, "uncompressed_page_size", where), "uncompressed size", where
        ),
        compressed_size=_sized(_int(fields, 3, "compressed_page_size", where), "compressed size", where),
        crc=crc & 0xFFFFFFFF if isinstance(crc, int) else None,  # Thrift stores it as a signed i32
        num_values=0,
        encoding=PLAIN,
        level_encoding=RLE,
        def_levels_size=0,
        rep_levels_size=0,
        is_compressed=True,
    )
    if kind == DATA_PAGE:
        d = _struct(fields, 5, "data_page_header", where)
        return replace(
            common,
            num_values=_count(d, 1, where),
            encoding=_int(d, 2, "encoding", where),
            level_encoding=_int(d, 3, "definition_level_encoding", where),
        )
    if kind == DICTIONARY_PAGE:
        d = _struct(fields, 7, "dictionary_page_header", where)
        return replace(common, num_values=_count(d, 1, where), encoding=_int(d, 2, "encoding", where))
    if kind == DATA_PAGE_V2:
        d = _struct(fields, 8, "data_page_header_v2", where)
        num_values, num_rows = _count(d, 1, where), _int(d, 3, "num_rows", where)
        if num_rows != num_values:  # without repetition levels a value is a row
            raise ParquetPageError(f"{where}: num_rows {num_rows} is not num_values {num_values}")
        return replace(
            common,
            num_values=num_values,
            encoding=_int(d, 4, "encoding", where),
            def_levels_size=_sized(_int(d, 5, "definition_levels_byte_length", where), "levels size", where),
            rep_levels_size=_sized(_int(d, 6, "repetition_levels_byte_length", where), "levels size", where),
            is_compressed=bool(d.get(7, 1)),
        )
    if kind != INDEX_PAGE:
        raise ParquetPageError(f"{where}: unknown page type {kind}")
    return common


def _count(fields: Fields, key: int, where: str) -> int:
    return _sized(_int(fields, key, "num_values", where), "num_values", where, 0x7FFFFFFF)


def read_page_header(
    read_at: ReadAt, offset: int, end: int, guess: int = FIRST_HEADER_READ
) -> tuple[PageHeader, int]:
    """The header at ``offset`` and its size; it must end before ``end``. One read of ``guess``
    bytes, unless the header is longer."""
    where = f"page header at {offset}"
    want = min(max(guess, 1), end - offset)
    while True:
        reader = _Compact(read_exactly(read_at, offset, want, where), where)
        try:
            fields = reader.struct()
        except _Truncated as t:
            limit = min(end - offset, MAX_HEADER)
            if want >= limit:
                raise ParquetPageError(
                    f"{where}: runs past {limit} bytes (the chunk's end or the limit)"
                ) from None
            want = min(limit, max(want * 8, t.need))
            continue
        return page_header(fields, where), reader.pos


def read_exactly(read_at: ReadAt, offset: int, size: int, what: str) -> memoryview:
    data = read_at(offset, size)
    if len(data) != size:
        raise ParquetPageError(f"{what}: the file ends: {len(data)} of {size} bytes at {offset}")
    return memoryview(data)
