"""What a Parquet page is to this reader: its limits (NOTE [ Untrusted pages ] in ``pages``), its
header, where it lies, and the error damage raises."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
ENCODING_NAMES = {
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

U32 = struct.Struct("<I")
HADOOP_BLOCK = struct.Struct(">II")
BIT_SHIFTS = np.arange(32, dtype=np.uint32)
BYTE_BITS = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


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
