"""One value of a BYTE_ARRAY column of a Parquet file, read from the one data page that holds it.

pyarrow reads whole column chunks: one image of a row group costs the decoding of all of them. Here
a chunk's page headers are read once (``ChunkPages.scan``) into a page map; a row's value then needs
only its page's bytes, and the dictionary page's when its page is dictionary-encoded (``ranges_for``),
which a caller can fetch for a whole batch before ``value``/``values`` decode from them.

NOTE [ Parquet page layout ]
    A column chunk is a run of pages, each a Thrift compact-protocol ``PageHeader`` and then
    ``compressed_page_size`` bytes. At most one dictionary page, first; then data pages, whose
    ``num_values`` (one per row: lists are refused, so there are no repetition levels) add up to the
    row group's rows. A version 1 data page compresses, as one body, the definition levels (a 4-byte
    little-endian length, then the RLE/bit-packed hybrid) and the values; a version 2 one keeps the
    levels uncompressed in front (their length is in the header) and compresses only the values.
    Nulls have a definition level below the column's maximum and no value. Values are PLAIN (each a
    4-byte little-endian length and the bytes) or indices into the dictionary page's PLAIN values (a
    bit-width byte, then the hybrid). pyarrow dictionary-encodes a chunk until its dictionary page
    would pass 1 MiB, then writes PLAIN pages: both kinds are found in one chunk.

NOTE [ Untrusted pages ]
    Every size, count, length and bit width read from the file is checked against what holds it (the
    chunk's extent, the page, ``MAX_PAGE``) before it is used, so damage is a ``ParquetPageError``
    naming what was wrong, and no read, allocation or loop grows with a number the file made up: a
    header is parsed from at most ``MAX_HEADER`` bytes with at most ``MAX_HEADER_VALUES`` values
    nested ``MAX_DEPTH`` deep, a level or index stream is walked for at most ``MAX_RUNS`` runs, and a
    chunk has at most one page per row (plus a few). pyarrow's decompressors fill the output buffer
    they are given without saying how much they wrote, so each codec is made to prove that it
    produced exactly the header's size (``decompress``): bytes that were never written are never
    handed out as an image. A page's CRC, where the writer stored one, is checked before anything else.
    And a page is checked whole before any row of it is served, the verdict kept with the page map:
    its levels must give exactly its rows (counted, never listed row by row), its PLAIN values must
    be exactly as many as its levels say are there and fill it to its last byte, and its
    dictionary indices must be as many and every one inside the dictionary (a bit-packed run may
    end in padding, so trailing bits are not checked). Reading only up to the row asked for served
    rows ahead of damage further on in pages pyarrow refuses whole, some with another row's image.
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

ReadAt = Callable[[int, int], bytes]
"""``read_at(offset, size)``: the file's bytes there, fewer only where the file ends (``os.pread``)."""

MAX_PAGE = 256 << 20
"""Largest page, compressed or not: writers cut pages near 1 MiB; more is damage, or a bomb."""
MAX_HEADER = 16 << 20  # parquet-cpp's own limit on a page header
FIRST_HEADER_READ = 1024
"""A header is ~25 bytes, more with statistics: pyarrow's hold min and max values of up to 4 KiB each,
so a header is read with twice the last one's size, at least this. Twice the *longest* so far made
one large header cost that much for every header after it (674 MB read for 8000 tiny pages)."""
MAX_HEADER_VALUES = 10_000  # a PageHeader has ~20 fields: this bounds a header made of tiny values
MAX_DEPTH = 16
MAX_RUNS = 1 << 20
"""Runs walked in one level or index stream: a writer's runs cover 8 values or more, and pages hold
at most tens of thousands of values, while 1-value runs of damage could make a Python loop crawl."""
PIECE = 1 << 16  # values of a bit-packed run unpacked at once
SWAR_BYTES = 1 << 18  # bytes of levels counted at once: temporaries that stay in cache
EXTRA_PAGES = 64  # pages beyond one per row: dictionary and index pages
MAX_PAGE_VALUES = 1 << 20
"""Values (nulls aside) one page may hold: checking a page whole walks each, and a column of images
has a few a page. Nulls cost nothing: a page of millions of them reads at once."""
HOP_READS = 64
"""Values of a raw page whose lengths are read one by one; a page with more is read whole once."""
MAX_HADOOP_BLOCKS = 4096  # Hadoop's LZ4 blocks are 256 KiB or so: a page has a few

DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY = 0, 2, 3, 8
_ENCODINGS = {
    0: "PLAIN",
    1: "GROUP_VAR_INT",
    2: "PLAIN_DICTIONARY",
    3: "RLE",
    4: "BIT_PACKED",
    5: "DELTA_BINARY_PACKED",
    6: "DELTA_LENGTH_BYTE_ARRAY",
    7: "DELTA_BYTE_ARRAY",
    8: "RLE_DICTIONARY",
    9: "BYTE_STREAM_SPLIT",
}
CODECS = frozenset(("UNCOMPRESSED", "SNAPPY", "GZIP", "ZSTD", "LZ4", "LZ4_RAW", "BROTLI"))

_U32 = struct.Struct("<I")
_HADOOP_BLOCK = struct.Struct(">II")
_SHIFTS = np.arange(32, dtype=np.uint32)
_BYTE_BITS = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


class ParquetPageError(Exception):
    """The file's bytes are not what its metadata says (damage), or use what this reader does not
    (an encoding other than PLAIN and dictionary, lists): ``str()`` is the reason."""


@dataclass(frozen=True)
class Chunk:
    """One column chunk of one row group, as the footer describes it (pyarrow's
    ``FileMetaData.row_group(g).column(c)`` and ``schema.column(c)``)."""

    start: int  # dictionary_page_offset if the chunk has one, else data_page_offset
    size: int  # total_compressed_size: headers included
    codec: str  # pyarrow's name: "UNCOMPRESSED", "SNAPPY", "GZIP", "ZSTD", "LZ4", "LZ4_RAW", "BROTLI"
    rows: int  # rows in the row group
    max_def: int  # max definition level of the leaf: 2 for the bytes of a nullable struct<bytes>
    max_rep: int  # anything but 0 (a list) is refused


@dataclass(frozen=True)
class PageHeader:
    """What this reader uses of a Thrift ``PageHeader``; fields of other page types are 0."""

    kind: int  # DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE or DATA_PAGE_V2
    uncompressed_size: int
    compressed_size: int
    crc: int | None  # CRC-32 of the bytes after the header, unsigned
    num_values: int
    encoding: int
    level_encoding: int  # version 1: the definition levels'
    def_levels_size: int  # version 2: the levels' bytes, before the values
    rep_levels_size: int
    is_compressed: bool  # version 2: whether the values are


@dataclass(frozen=True)
class Page:
    """One page of a chunk: where it is and what its header says."""

    offset: int  # of its header in the file
    header_size: int
    header: PageHeader
    first_row: int  # of the row group; 0 for a dictionary page

    @property
    def length(self) -> int:
        return self.header_size + self.header.compressed_size

    @property
    def rows(self) -> int:
        return self.header.num_values if self.header.kind in (DATA_PAGE, DATA_PAGE_V2) else 0

    @property
    def uses_dictionary(self) -> bool:
        return self.header.encoding in (PLAIN_DICTIONARY, RLE_DICTIONARY)


# --- Thrift compact protocol ---------------------------------------------------------------------

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


# --- The page map --------------------------------------------------------------------------------


def _check_chunk(chunk: Chunk) -> None:
    if chunk.max_rep != 0:
        raise ParquetPageError(f"max repetition level {chunk.max_rep}: lists are not supported")
    if not 0 <= chunk.max_def <= 32:
        raise ParquetPageError(f"max definition level {chunk.max_def} is outside 0..32")
    if chunk.codec not in CODECS:
        raise ParquetPageError(f"codec {chunk.codec!r} is not supported")
    if chunk.start < 0 or chunk.size <= 0 or chunk.rows < 0:
        raise ParquetPageError(f"chunk at {chunk.start} of {chunk.size} bytes and {chunk.rows} rows")


def _check_page(chunk: Chunk, page: Page, where: str) -> None:
    h = page.header
    if h.kind == DICTIONARY_PAGE:
        if h.encoding not in (PLAIN, PLAIN_DICTIONARY):
            raise ParquetPageError(f"{where}: dictionary encoding {_ENCODINGS.get(h.encoding, h.encoding)}")
        if h.num_values > h.uncompressed_size // 4:  # each value has a 4-byte length at least
            raise ParquetPageError(f"{where}: {h.num_values} values in {h.uncompressed_size} bytes")
    if h.kind not in (DATA_PAGE, DATA_PAGE_V2):
        return
    if h.encoding not in (PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY):
        raise ParquetPageError(f"{where}: encoding {_ENCODINGS.get(h.encoding, h.encoding)} is not supported")
    if h.kind == DATA_PAGE and chunk.max_def and h.level_encoding != RLE:
        name = _ENCODINGS.get(h.level_encoding, h.level_encoding)
        raise ParquetPageError(f"{where}: definition level encoding {name} is not supported")
    levels = h.def_levels_size + h.rep_levels_size
    if h.rep_levels_size or (h.def_levels_size and not chunk.max_def):
        raise ParquetPageError(f"{where}: levels of {levels} bytes in a column that has none")
    if levels > min(h.compressed_size, h.uncompressed_size):
        raise ParquetPageError(f"{where}: levels of {levels} bytes in a page of {h.compressed_size}")
    if (chunk.codec == "UNCOMPRESSED" or not h.is_compressed) and h.compressed_size != h.uncompressed_size:
        raise ParquetPageError(
            f"{where}: {h.compressed_size} stored bytes but {h.uncompressed_size} uncompressed"
        )


class ChunkPages:
    """The page map of one chunk, read from its page headers (and, for ``span``, the value lengths of
    the raw pages it was asked about)."""

    def __init__(self, chunk: Chunk, dictionary: Page | None, pages: Sequence[Page]) -> None:
        self.chunk = chunk
        self.dictionary = dictionary
        self.pages = tuple(pages)  # data pages with values, in row order
        self._first_rows = [p.first_row for p in self.pages]
        self._raw: dict[int, RawPage] = {}
        """Of the pages ``span`` has read, by index: their levels and where each value is."""
        self._verdicts: dict[int, ParquetPageError | None] = {}
        """Of the pages checked whole (NOTE [ Untrusted pages ]), by index (-1: the dictionary)."""

    @classmethod
    def scan(cls, chunk: Chunk, read_at: ReadAt) -> ChunkPages:
        """Every page header of ``chunk``, one small read each."""
        _check_chunk(chunk)
        end = chunk.start + chunk.size
        offset, rows, count, guess = chunk.start, 0, 0, FIRST_HEADER_READ
        dictionary: Page | None = None
        pages: list[Page] = []
        while offset < end:
            count += 1
            if count > chunk.rows + EXTRA_PAGES:
                raise ParquetPageError(
                    f"chunk at {chunk.start}: more than {count - 1} pages for {chunk.rows} rows"
                )
            header, header_size = read_page_header(read_at, offset, end, guess)
            guess = max(FIRST_HEADER_READ, 2 * header_size)
            page = Page(offset, header_size, header, rows)
            where = f"page at {offset}"
            if offset + page.length > end:
                raise ParquetPageError(f"{where}: its {page.length} bytes run past the chunk's end at {end}")
            _check_page(chunk, page, where)
            if header.kind == DICTIONARY_PAGE:
                if dictionary is not None or pages or rows:
                    raise ParquetPageError(f"{where}: a dictionary page after the chunk's first page")
                dictionary = page
            elif page.rows:
                if page.uses_dictionary and dictionary is None:
                    raise ParquetPageError(
                        f"{where}: dictionary-encoded, but the chunk has no dictionary page"
                    )
                rows += page.rows
                if rows > chunk.rows:
                    raise ParquetPageError(f"{where}: pages hold more than the row group's {chunk.rows} rows")
                pages.append(page)
            offset += page.length
        if rows != chunk.rows:
            raise ParquetPageError(f"chunk at {chunk.start}: its pages hold {rows} of {chunk.rows} rows")
        return cls(chunk, dictionary, pages)

    def page_index(self, row: int) -> int:
        if not 0 <= row < self.chunk.rows:
            raise IndexError(f"row {row} of a row group of {self.chunk.rows}")
        return bisect.bisect_right(self._first_rows, row) - 1

    def page_of(self, row: int) -> tuple[int, int]:
        """(file offset, length) of the page holding ``row``: its header and its data."""
        page = self.pages[self.page_index(row)]
        return page.offset, page.length

    def ranges_for(self, row: int) -> list[tuple[int, int]]:
        """Every (file offset, length) that ``value(row)`` reads: the dictionary page first, where
        the row's page is dictionary-encoded; ``read_at`` is called with exactly these."""
        page = self.pages[self.page_index(row)]
        ranges = [(page.offset, page.length)]
        if page.uses_dictionary and self.dictionary is not None:
            ranges.insert(0, (self.dictionary.offset, self.dictionary.length))
        return ranges

    def stored_raw(self, row: int) -> bool:
        """Whether the page holding ``row`` keeps its values as they are (uncompressed, PLAIN, no
        CRC to check over the whole page), so each value's bytes lie at a place of their own in the
        file (``span``): what ``datasets`` writes for an image column."""
        h = self.pages[self.page_index(row)].header
        uncompressed = self.chunk.codec == "UNCOMPRESSED" or (h.kind == DATA_PAGE_V2 and not h.is_compressed)
        return uncompressed and h.encoding == PLAIN and h.crc is None

    def span(self, row: int, read_at: ReadAt) -> tuple[int, int] | None:
        """(file offset, length) of the value at ``row``, None for a null, in a page ``stored_raw``
        (NOTE [ Parquet reads ]): the page's levels and value lengths are read once, a few small
        reads, and then each value costs its own bytes only."""
        index = self.page_index(row)
        raw = self._raw.get(index)
        if raw is None:
            self._verdict(index, None)  # a page found damaged before stays so
            try:
                raw = self._raw[index] = RawPage.read(self.pages[index], self.chunk, read_at)
            except ParquetPageError as exc:
                self._verdicts[index] = exc
                raise
            self._verdicts[index] = None
        return raw.span(row - self.pages[index].first_row, self.chunk.max_def)

    def value(self, row: int, read_at: ReadAt) -> bytes | None:
        """The value at ``row`` of the row group, None for a null."""
        return self.values([row], read_at)[0]

    def values(self, rows: Iterable[int], read_at: ReadAt) -> list[bytes | None]:
        """The values at ``rows``, in their order; each page, and the dictionary, read and
        decompressed once."""
        wanted = list(rows)
        by_page: dict[int, list[int]] = {}
        for row in wanted:
            by_page.setdefault(self.page_index(row), []).append(row)
        found: dict[int, bytes | None] = {}
        dictionary: list[memoryview] = []  # read at the first page that needs it, once
        for index, page_rows in sorted(by_page.items()):
            page = self.pages[index]
            positions = sorted({row - page.first_row for row in page_rows})
            for position, value in zip(
                positions, self._page_values(page, positions, read_at, dictionary), strict=True
            ):
                found[page.first_row + position] = value
        return [found[row] for row in wanted]

    def _page_values(
        self, page: Page, positions: list[int], read_at: ReadAt, dictionary: list[memoryview]
    ) -> list[bytes | None]:
        where = f"page at {page.offset}"
        levels, data = page_data(page, self.chunk, read_exactly(read_at, page.offset, page.length, where))
        self._verdict(self.page_index(page.first_row), lambda: self._check(page, levels, data, read_at))
        if self.chunk.max_def:
            present = levels_at(levels, self.chunk.max_def, positions, f"{where}, definition levels")
        else:
            present = [(True, p) for p in positions]
        keys = sorted({k for ok, k in present if ok})
        if page.uses_dictionary:
            indices = indices_at(data, keys, f"{where}, dictionary indices")
            entries = sorted(set(indices))
            by_entry = dict(zip(entries, self._entries(entries, read_at, dictionary, where), strict=True))
            by_key = {k: by_entry[i] for k, i in zip(keys, indices, strict=True)}
        else:
            by_key = dict(zip(keys, plain_at(data, keys, f"{where}, values"), strict=True))
        return [by_key[k] if ok else None for ok, k in present]

    def _verdict(self, index: int, check: Callable[[], None] | None) -> None:
        """Raise what is wrong with page ``index`` (-1: the dictionary), checking it whole with
        ``check`` the first time (NOTE [ Untrusted pages ]); None only asks for a verdict reached."""
        if index in self._verdicts:
            found = self._verdicts[index]
            if found is not None:
                raise found
            return
        if check is None:
            return
        try:
            check()
        except ParquetPageError as exc:
            self._verdicts[index] = exc
            raise
        self._verdicts[index] = None

    def _check(self, page: Page, levels: memoryview, data: memoryview, read_at: ReadAt) -> None:
        """A data page whole: its levels, and its values or dictionary indices, to its last byte."""
        where = f"page at {page.offset}"
        present = present_count(levels, self.chunk.max_def, page.rows, f"{where}, definition levels")
        if not page.uses_dictionary:
            plain_spans(data, present, f"{where}, values")
            return
        assert self.dictionary is not None  # scan refused dictionary-encoded pages without one
        self._verdict(-1, lambda: self._check_dictionary(read_at))
        check_indices(data, present, self.dictionary.header.num_values, f"{where}, dictionary indices")

    def _check_dictionary(self, read_at: ReadAt) -> None:
        assert self.dictionary is not None
        plain_spans(self._dictionary(read_at), self.dictionary.header.num_values, "the dictionary page")

    def _entries(
        self, entries: list[int], read_at: ReadAt, dictionary: list[memoryview], where: str
    ) -> list[bytes]:
        """The dictionary's values at the sorted ``entries``; its page read into ``dictionary``
        at the first call of a ``values`` that has any."""
        if not entries:
            return []
        assert self.dictionary is not None  # scan refused dictionary-encoded pages without one
        if entries[-1] >= self.dictionary.header.num_values:
            raise ParquetPageError(
                f"{where}: dictionary index {entries[-1]} of {self.dictionary.header.num_values}"
            )
        if not dictionary:
            dictionary.append(self._dictionary(read_at))
        return plain_at(dictionary[0], entries, f"dictionary of {where}")

    def _dictionary(self, read_at: ReadAt) -> memoryview:
        page = self.dictionary
        assert page is not None
        where = f"dictionary page at {page.offset}"
        _, data = page_data(page, self.chunk, read_exactly(read_at, page.offset, page.length, where))
        return data


# --- A page's bytes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawPage:
    """A raw PLAIN page (``ChunkPages.stored_raw``) checked whole: its definition levels, and where
    each of its values lies in the file."""

    levels: memoryview
    starts: npt.NDArray[np.int64]
    """Each value's first byte in the file, in order (nulls have none)."""
    sizes: npt.NDArray[np.int64]

    @classmethod
    def read(cls, page: Page, chunk: Chunk, read_at: ReadAt) -> RawPage:
        """The page's levels, then its values' lengths: one by one where they are few
        (``HOP_READS``), else from one read of the page's values; they must fill it exactly."""
        h = page.header
        where = f"page at {page.offset}"
        body, end = page.offset + page.header_size, page.offset + page.length
        if h.kind == DATA_PAGE_V2:
            levels_from, levels_size = body + h.rep_levels_size, h.def_levels_size
            values = body + h.rep_levels_size + h.def_levels_size
        elif chunk.max_def:
            (levels_size,) = _U32.unpack(read_exactly(read_at, body, 4, where))
            levels_from, values = body + 4, body + 4 + levels_size
        else:
            levels_from, levels_size, values = body, 0, body
        if values > end:
            raise ParquetPageError(f"{where}: levels of {levels_size} bytes in a page of {h.compressed_size}")
        levels = read_exactly(read_at, levels_from, levels_size, where) if chunk.max_def else memoryview(b"")
        present = present_count(levels, chunk.max_def, page.rows, f"{where}, definition levels")
        if present > HOP_READS:
            starts, sizes = plain_spans(read_exactly(read_at, values, end - values, where), present, where)
            return cls(levels, starts + values, sizes)
        starts, sizes = np.empty(present, np.int64), np.empty(present, np.int64)
        at = values
        for k in range(present):
            (size,) = _U32.unpack(read_exactly(read_at, at, 4, f"{where}, value {k}"))
            if at + 4 + size > end:
                raise ParquetPageError(f"{where}: value {k} of {size} bytes runs past the page's end")
            starts[k], sizes[k] = at + 4, size
            at += 4 + size
        if at != end:
            raise ParquetPageError(f"{where}: {end - at} bytes after its {present} values")
        return cls(levels, starts, sizes)

    def span(self, position: int, max_def: int) -> tuple[int, int] | None:
        """(file offset, length) of the value at ``position`` of the page, None for a null."""
        there, rank = (
            levels_at(self.levels, max_def, [position], "definition levels")[0]
            if max_def
            else (True, position)
        )
        return (int(self.starts[rank]), int(self.sizes[rank])) if there else None


def present_count(levels: memoryview, max_def: int, rows: int, what: str) -> int:
    """How many of a page's ``rows`` have a value (their level is the maximum), the whole stream
    walked run by run and counted, never listed: millions of nulls cost a few runs."""
    if not max_def:
        return rows
    total = 0
    for _first, n, run in hybrid_runs(levels, max_def.bit_length(), rows, what):
        total += _present(run, 0, n, max_def, what)
    if total > MAX_PAGE_VALUES:
        raise ParquetPageError(f"{what}: {total} values in one page, over {MAX_PAGE_VALUES}")
    return total


def plain_spans(
    data: memoryview, count: int, what: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Where each of ``count`` PLAIN byte arrays in ``data`` begins (after its 4-byte length), and
    its size; they must fill ``data`` to its last byte."""
    if count > MAX_PAGE_VALUES:
        raise ParquetPageError(f"{what}: {count} values, over {MAX_PAGE_VALUES}")
    starts, sizes = np.empty(count, np.int64), np.empty(count, np.int64)
    pos, end = 0, len(data)
    for k in range(count):
        if pos + 4 > end:
            raise ParquetPageError(f"{what}: value {k} starts past the end ({end} bytes)")
        (size,) = _U32.unpack_from(data, pos)
        if size > end - pos - 4:
            raise ParquetPageError(f"{what}: value {k} of {size} bytes runs past the end ({end} bytes)")
        starts[k], sizes[k] = pos + 4, size
        pos += 4 + size
    if pos != end:
        raise ParquetPageError(f"{what}: {end - pos} bytes after its {count} values")
    return starts, sizes


def check_indices(data: memoryview, count: int, entries: int, what: str) -> None:
    """A dictionary-encoded page's index stream holds ``count`` indices, each below ``entries``."""
    if not count:
        return
    if not data:
        raise ParquetPageError(f"{what}: no bit width")
    bit_width = data[0]
    if bit_width > 32:
        raise ParquetPageError(f"{what}: bit width {bit_width}")
    for first, n, run in hybrid_runs(data[1:], bit_width, count, what):
        if isinstance(run, Packed):
            for lo in range(0, n, PIECE):  # a multiple of 8 values: whole bytes
                piece = run.data[lo * bit_width // 8 : ((lo + PIECE) * bit_width + 7) // 8]
                top = int(unpack(piece, bit_width, min(PIECE, n - lo)).max())
                if top >= entries:
                    raise ParquetPageError(f"{what}: index {top} near value {first + lo} of {entries}")
        elif run >= entries:
            raise ParquetPageError(f"{what}: index {run} at value {first} of {entries}")


def page_data(page: Page, chunk: Chunk, raw: memoryview) -> tuple[memoryview, memoryview]:
    """A page's definition levels (the hybrid stream; empty for none) and its values, decompressed,
    from ``raw``: the page's header and data as the file has them."""
    h = page.header
    where = f"page at {page.offset}"
    body = raw[page.header_size :]
    if h.crc is not None and zlib.crc32(body) != h.crc:
        raise ParquetPageError(f"{where}: CRC mismatch: the page's bytes are damaged")
    if h.kind == DATA_PAGE_V2:
        split = h.rep_levels_size + h.def_levels_size
        values = body[split:]
        if h.is_compressed:
            values = decompress(chunk.codec, values, h.uncompressed_size - split, where)
        return body[h.rep_levels_size : split], values
    data = decompress(chunk.codec, body, h.uncompressed_size, where)
    if h.kind == DICTIONARY_PAGE or not chunk.max_def:  # no levels, so no length in front of them
        return data[:0], data
    if len(data) < 4:
        raise ParquetPageError(f"{where}: {len(data)} bytes, too few for the levels' length")
    (size,) = _U32.unpack_from(data, 0)
    if size > len(data) - 4:
        raise ParquetPageError(f"{where}: levels of {size} bytes in a page of {len(data)}")
    return data[4 : 4 + size], data[4 + size :]


def decompress(codec: str, data: memoryview, size: int, where: str) -> memoryview:
    """``data`` decompressed into exactly ``size`` bytes, or ParquetPageError.

    pyarrow returns the whole buffer it was asked for even where the codec wrote less, so each codec
    is checked some other way: ZSTD by pyarrow itself (it compares the frame's output with the
    size), SNAPPY by the length at the start of its stream, GZIP by decompressing with zlib, and LZ4
    and BROTLI by failing to decompress into one byte less.
    """
    try:
        if codec == "UNCOMPRESSED":
            out: bytes | memoryview = data
        elif codec == "GZIP":
            out = _gunzip(data, size, where)
        elif codec == "SNAPPY":
            _check_snappy_length(data, size, where)
            out = _pyarrow_decompress(data, size, "snappy")
        elif codec == "ZSTD":
            out = _pyarrow_decompress(data, size, "zstd")
        elif codec in ("LZ4", "LZ4_RAW"):
            out = _lz4(data, size, where)
        else:
            out = _exact(data, size, "brotli", where)
    except (_CodecError, zlib.error) as e:
        raise ParquetPageError(f"{where}: the {codec} data does not decompress: {e}") from None
    if len(out) != size:
        raise ParquetPageError(f"{where}: {len(out)} bytes where the header says {size}")
    return memoryview(out)


class _CodecError(Exception):
    """pyarrow's codec refused the data (or is not built in)."""


def _pyarrow_decompress(data: memoryview, size: int, codec: str) -> bytes:
    import pyarrow as pa  # only here: a reader of uncompressed pages needs no pyarrow

    try:
        out: bytes = pa.decompress(data, size, codec=codec, asbytes=True)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise _CodecError(str(e)) from None
    return out


def _exact(data: memoryview, size: int, codec: str, where: str) -> bytes:
    out = _pyarrow_decompress(data, size, codec)
    if size:
        try:
            _pyarrow_decompress(data, size - 1, codec)
        except _CodecError:
            return out
        raise ParquetPageError(f"{where}: the {codec} data holds fewer bytes than the header's {size}")
    return out


def _gunzip(data: memoryview, size: int, where: str) -> bytes:
    inflate = zlib.decompressobj(wbits=47)  # 32 + 15: a gzip or a zlib header
    out = inflate.decompress(data, size + 1)  # max_length 0 would mean no limit
    if len(out) != size or not inflate.eof or inflate.unused_data:
        raise ParquetPageError(f"{where}: the GZIP data is not one stream of {size} bytes")
    return out


def _check_snappy_length(data: memoryview, size: int, where: str) -> None:
    length, shift = 0, 0
    for b in data[:5]:
        length |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if length != size:
                raise ParquetPageError(f"{where}: SNAPPY data of {length} bytes where the header says {size}")
            return
    raise ParquetPageError(f"{where}: no SNAPPY length")


def _lz4(data: memoryview, size: int, where: str) -> bytes:
    # pyarrow names both Parquet's LZ4 (Hadoop's framing, or raw blocks from some writers) and
    # LZ4_RAW "LZ4"; like parquet-cpp, try the framing first and fall back on one raw block.
    framed = _lz4_hadoop(data, size, where)
    return framed if framed is not None else _exact(data, size, "lz4_raw", where)


def _lz4_hadoop(data: memoryview, size: int, where: str) -> bytes | None:
    blocks: list[bytes] = []
    pos, total = 0, 0
    while len(data) - pos >= 8:
        out_size, in_size = _HADOOP_BLOCK.unpack_from(data, pos)
        pos += 8
        if in_size > len(data) - pos or out_size > size - total or len(blocks) >= MAX_HADOOP_BLOCKS:
            return None
        try:
            blocks.append(_exact(data[pos : pos + in_size], out_size, "lz4_raw", where))
        except (_CodecError, ParquetPageError):
            return None
        pos += in_size
        total += out_size
    return b"".join(blocks) if pos == len(data) and total == size else None


# --- Levels, indices and values ------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """A bit-packed run's values, packed from the lowest bit up; ``data`` holds all of them."""

    data: memoryview
    bit_width: int
    count: int

    def at(self, index: int) -> int:
        """One value, without unpacking those before it."""
        bit = index * self.bit_width
        word = int.from_bytes(self.data[bit >> 3 : (bit + self.bit_width + 7) >> 3], "little")
        return (word >> (bit & 7)) & ((1 << self.bit_width) - 1)

    def tally(self, start: int, stop: int, value: int) -> tuple[int, int]:
        """How many of the values [start, stop) are ``value``, and how many are above it.

        Widths that divide 8 (every level width up to a max level of 15) are counted on whole
        bytes as 64-bit words, without unpacking: a 1 MiB page's levels in well under a millisecond.
        """
        per_byte = 8 // self.bit_width if self.bit_width in (1, 2, 4, 8) else 0
        if not per_byte:
            return self._tally_unpacked(start, stop, value)
        first, last = -(-start // per_byte), stop // per_byte
        if first >= last:
            return self._tally_each(range(start, stop), value)
        head = self._tally_each(range(start, first * per_byte), value)
        tail = self._tally_each(range(last * per_byte, stop), value)
        equal, above = 0, 0
        for lo in range(first, last, SWAR_BYTES):  # bounds the temporaries
            raw = np.frombuffer(self.data, dtype=np.uint8, count=min(SWAR_BYTES, last - lo), offset=lo)
            e, a = _swar_tally(raw, self.bit_width, value)
            equal, above = equal + e, above + a
        return head[0] + tail[0] + equal, head[1] + tail[1] + above

    def _tally_each(self, indices: range, value: int) -> tuple[int, int]:
        values = [self.at(i) for i in indices]
        return values.count(value), sum(v > value for v in values)

    def _tally_unpacked(self, start: int, stop: int, value: int) -> tuple[int, int]:
        equal, above = 0, 0
        for lo in range(start // 8 * 8, stop, PIECE):  # whole groups of 8 values: whole bytes
            hi = min(lo + PIECE, stop)
            data = self.data[lo // 8 * self.bit_width : (hi * self.bit_width + 7) // 8]
            values = unpack(data, self.bit_width, hi - lo)[max(start - lo, 0) :]
            equal += int(np.count_nonzero(values == value))
            above += int(np.count_nonzero(values > value))
        return equal, above


def _swar_tally(raw: npt.NDArray[np.uint8], bit_width: int, value: int) -> tuple[int, int]:
    """``Packed.tally`` of whole bytes of fields of ``bit_width`` (1, 2, 4 or 8) bits."""
    if bit_width == 8:
        return int(np.count_nonzero(raw == value)), int(np.count_nonzero(raw > value))
    whole = len(raw) // 8 * 8
    last = np.zeros(8, dtype=np.uint8)  # the bytes after the whole words, and fields of 0 after them
    last[: len(raw) - whole] = raw[whole:]
    padding = (8 - len(raw) + whole) * (8 // bit_width)
    equal, above = -padding if value == 0 else 0, 0
    for words in (raw[:whole].view(np.uint64), last.view(np.uint64)):  # a view: no copy of the page
        equal += _fields_equal(words, bit_width, value)
        above += sum(_fields_equal(words, bit_width, v) for v in range(value + 1, 1 << bit_width))
    return equal, above


def _fields_equal(words: npt.NDArray[np.uint64], bit_width: int, value: int) -> int:
    """How many ``bit_width``-bit fields of ``words`` hold ``value``: those whose bits all match."""
    fields = 64 // bit_width
    pattern = np.uint64(sum(value << (i * bit_width) for i in range(fields)))
    low_bits = np.uint64(sum(1 << (i * bit_width) for i in range(fields)))
    same = np.bitwise_xor(words, pattern)
    np.invert(same, out=same)  # in place: a fresh temporary of a page's size costs page faults
    all_same = same.copy() if bit_width > 1 else same
    for shift in range(1, bit_width):
        np.bitwise_and(all_same, same >> np.uint64(shift), out=all_same)
    np.bitwise_and(all_same, low_bits, out=all_same)
    return _popcount(all_same)


def _popcount(words: npt.NDArray[np.uint64]) -> int:
    if hasattr(np, "bitwise_count"):  # numpy 2
        return int(np.bitwise_count(words).sum())
    return int(_BYTE_BITS[words.view(np.uint8)].sum())


Run = tuple[int, int, int | Packed]


def hybrid_runs(data: memoryview, bit_width: int, count: int, what: str) -> Iterator[Run]:
    """(first position, values, the value or the packed values) of the runs of an RLE/bit-packed
    hybrid stream, until ``count`` values; the last run is cut to end there."""
    value_bytes = (bit_width + 7) // 8
    pos, got, runs = 0, 0, 0
    while got < count:
        runs += 1
        if runs > MAX_RUNS:
            raise ParquetPageError(f"{what}: more than {MAX_RUNS} runs")
        header, pos = _uvarint(data, pos, what)
        n = header >> 1
        if n == 0:
            raise ParquetPageError(f"{what}: a run of no values at byte {pos}")
        if header & 1:  # n groups of 8 bit-packed values
            take = min(n * 8, count - got)
            size = (take * bit_width + 7) // 8
            if pos + size > len(data):
                raise ParquetPageError(f"{what}: ends inside a bit-packed run at byte {pos}")
            yield got, take, Packed(data[pos : pos + size], bit_width, take)
            pos += n * bit_width
        else:
            if pos + value_bytes > len(data):
                raise ParquetPageError(f"{what}: ends inside a run at byte {pos}")
            value = int.from_bytes(data[pos : pos + value_bytes], "little")
            pos += value_bytes
            if value >> bit_width:
                raise ParquetPageError(f"{what}: run value {value} is wider than {bit_width} bits")
            take = min(n, count - got)
            yield got, take, value
        got += take


def _uvarint(data: memoryview, pos: int, what: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 35, 7):  # a run header is 32 bits: 5 bytes
        if pos >= len(data):
            raise ParquetPageError(f"{what}: ends before all its values")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
    raise ParquetPageError(f"{what}: a run header longer than 5 bytes at byte {pos}")


def unpack(data: memoryview, bit_width: int, count: int) -> npt.NDArray[np.uint32]:
    """``count`` values of ``bit_width`` bits packed from the lowest bit of ``data`` up."""
    if bit_width == 0:
        return np.zeros(count, dtype=np.uint32)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[: count * bit_width]
    weighted = bits.reshape(count, bit_width).astype(np.uint32) << _SHIFTS[:bit_width]
    out: npt.NDArray[np.uint32] = weighted.sum(axis=1, dtype=np.uint32)
    return out


def levels_at(data: memoryview, max_def: int, positions: Sequence[int], what: str) -> list[tuple[bool, int]]:
    """For each of the sorted ``positions`` of a page: whether its value is there (not null), and
    how many values there are before it (its place among the page's stored values)."""
    answers: list[tuple[bool, int]] = []
    present = 0  # values (not nulls) before the current position
    for first, n, run in hybrid_runs(data, max_def.bit_length(), positions[-1] + 1, what):
        done = 0  # the run's values counted in ``present``
        while len(answers) < len(positions) and positions[len(answers)] < first + n:
            at = positions[len(answers)] - first
            present += _present(run, done, at, max_def, what)
            done = at
            level = run.at(at) if isinstance(run, Packed) else run
            answers.append((level == max_def, present))  # a level above the maximum raises below
        present += _present(run, done, n, max_def, what)
    return answers


def _present(run: int | Packed, start: int, stop: int, max_def: int, what: str) -> int:
    """How many of a run's values [start, stop) are there: at the maximum level, which none passes."""
    if isinstance(run, Packed):
        equal, above = run.tally(start, stop, max_def)
    else:
        equal, above = (stop - start, 0) if run == max_def else (0, (stop - start) * (run > max_def))
    if above:
        raise ParquetPageError(f"{what}: {above} levels above the maximum {max_def}")
    return equal


def indices_at(data: memoryview, keys: Sequence[int], what: str) -> list[int]:
    """The dictionary indices at the sorted ``keys`` of a dictionary-encoded page's values."""
    if not keys:
        return []
    if not data:
        raise ParquetPageError(f"{what}: no bit width")
    bit_width = data[0]
    if bit_width > 32:
        raise ParquetPageError(f"{what}: bit width {bit_width}")
    indices: list[int] = []
    for first, n, run in hybrid_runs(data[1:], bit_width, keys[-1] + 1, what):
        while len(indices) < len(keys) and keys[len(indices)] < first + n:
            at = keys[len(indices)] - first
            indices.append(run.at(at) if isinstance(run, Packed) else run)
    return indices


def plain_at(data: memoryview, keys: Sequence[int], what: str) -> list[bytes]:
    """The PLAIN byte arrays at the sorted ``keys``: each a 4-byte length and its bytes, so finding
    one means hopping over all before it (a few for images of many KB, thousands for small values)."""
    found: list[bytes] = []
    pos, index, end = 0, 0, len(data)
    for key in keys:
        while True:
            if pos + 4 > end:
                raise ParquetPageError(f"{what}: value {index} starts past the end ({end} bytes)")
            (size,) = _U32.unpack_from(data, pos)
            if size > end - pos - 4:
                raise ParquetPageError(
                    f"{what}: value {index} of {size} bytes runs past the end ({end} bytes)"
                )
            if index == key:
                found.append(data[pos + 4 : pos + 4 + size].tobytes())
                break
            pos += 4 + size
            index += 1
    return found
