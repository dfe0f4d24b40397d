"""A page's bytes: its levels and values split apart (decompressed where the codec says), and a raw
PLAIN page checked whole."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loader_service.dataset.formats.parquet.codecs import decompress
from loader_service.dataset.formats.parquet.encodings import (
    Packed,
    hybrid_runs,
    levels_at,
    present_in_run,
    unpack,
)
from loader_service.dataset.formats.parquet.pagemodel import (
    DATA_PAGE_V2,
    DICTIONARY_PAGE,
    HOP_READS,
    MAX_PAGE_VALUES,
    PIECE,
    U32,
    Chunk,
    Page,
    ParquetPageError,
    ReadAt,
)
from loader_service.dataset.formats.parquet.thrift import read_exactly


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
            (levels_size,) = U32.unpack(read_exactly(read_at, body, 4, where))
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
            (size,) = U32.unpack(read_exactly(read_at, at, 4, f"{where}, value {k}"))
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
        total += present_in_run(run, 0, n, max_def, what)
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
        (size,) = U32.unpack_from(data, pos)
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
    (size,) = U32.unpack_from(data, 0)
    if size > len(data) - 4:
        raise ParquetPageError(f"{where}: levels of {size} bytes in a page of {len(data)}")
    return data[4 : 4 + size], data[4 + size :]
