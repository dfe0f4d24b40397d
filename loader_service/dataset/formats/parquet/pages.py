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
from collections.abc import Callable, Iterable, Sequence

from loader_service.dataset.formats.parquet.encodings import indices_at, levels_at, plain_at
from loader_service.dataset.formats.parquet.pagebytes import (
    RawPage,
    check_indices,
    page_data,
    plain_spans,
    present_count,
)
from loader_service.dataset.formats.parquet.pagemodel import (
    CODECS,
    DATA_PAGE,
    DATA_PAGE_V2,
    DICTIONARY_PAGE,
    ENCODING_NAMES,
    EXTRA_PAGES,
    FIRST_HEADER_READ,
    PLAIN,
    PLAIN_DICTIONARY,
    RLE,
    RLE_DICTIONARY,
    Chunk,
    Page,
    ParquetPageError,
    ReadAt,
)
from loader_service.dataset.formats.parquet.thrift import read_exactly, read_page_header

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
            raise ParquetPageError(
                f"{where}: dictionary encoding {ENCODING_NAMES.get(h.encoding, h.encoding)}"
            )
        if h.num_values > h.uncompressed_size // 4:  # each value has a 4-byte length at least
            raise ParquetPageError(f"{where}: {h.num_values} values in {h.uncompressed_size} bytes")
    if h.kind not in (DATA_PAGE, DATA_PAGE_V2):
        return
    if h.encoding not in (PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY):
        raise ParquetPageError(
            f"{where}: encoding {ENCODING_NAMES.get(h.encoding, h.encoding)} is not supported"
        )
    if h.kind == DATA_PAGE and chunk.max_def and h.level_encoding != RLE:
        name = ENCODING_NAMES.get(h.level_encoding, h.level_encoding)
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
