"""The Parquet page reader (dataset/formats/parquet/pages.py and the modules it uses): one value of a
Parquet BYTE_ARRAY column, read from its own data page, against what pyarrow reads of the same files;
and damage of every kind, which must be a ParquetPageError."""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from loader_service.dataset.formats.parquet.encodings import indices_at, levels_at
from loader_service.dataset.formats.parquet.pagemodel import (
    DICTIONARY_PAGE,
    PLAIN,
    RLE_DICTIONARY,
    Chunk,
    ParquetPageError,
)
from loader_service.dataset.formats.parquet.pages import ChunkPages

ReadAt = Callable[[int, int], bytes]
CODECS = ("none", "snappy", "gzip", "zstd", "lz4", "brotli")
STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
LEAVES = ("b", "s.bytes")  # the plain binary column, and the bytes leaf of struct<bytes, path>


def chunk_of(metadata: pq.FileMetaData, group: int, column: int) -> Chunk:
    """What the footer says of one column chunk: how a caller fills a Chunk from pyarrow."""
    col = metadata.row_group(group).column(column)
    # The chunk starts at its dictionary page where it has one: data_page_offset is past it.
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    leaf = metadata.schema.column(column)
    return Chunk(
        start=start,
        size=col.total_compressed_size,
        codec=col.compression,
        rows=metadata.row_group(group).num_rows,
        max_def=leaf.max_definition_level,
        max_rep=leaf.max_repetition_level,
    )


def column_index(metadata: pq.FileMetaData, path: str) -> int:
    paths = [metadata.schema.column(c).path for c in range(metadata.num_columns)]
    return paths.index(path)


def reader(data: bytes) -> ReadAt:
    """``os.pread`` over ``data``: fewer bytes where it ends."""
    return lambda offset, size: data[offset : offset + size]


def only(data: bytes, ranges: list[tuple[int, int]]) -> ReadAt:
    """A reader of exactly ``ranges``: what a caller that fetched ``ranges_for`` in advance has."""

    def read_at(offset: int, size: int) -> bytes:
        assert (offset, size) in ranges, f"read of {size} bytes at {offset} outside {ranges}"
        return data[offset : offset + size]

    return read_at


def expected(table: pa.Table, leaf: str) -> list[bytes | None]:
    """pyarrow's values of ``leaf``: a column, or a field of a struct column (null where it is)."""
    column, _, field = leaf.partition(".")
    values: list[Any] = table.column(column).to_pylist()
    return [None if v is None else v[field] for v in values] if field else values


def chunks(path: Path, leaf: str) -> Iterator[tuple[Chunk, int]]:
    """Each row group's chunk of ``leaf``, and the group's first row in the file."""
    metadata = pq.read_metadata(path)
    c = column_index(metadata, leaf)
    first = 0
    for g in range(metadata.num_row_groups):
        yield chunk_of(metadata, g, c), first
        first += metadata.row_group(g).num_rows


def check_file(path: Path, leaves: tuple[str, ...] = LEAVES) -> list[ChunkPages]:
    """Every row of ``leaves`` through value() (reading only ranges_for) and values(), against
    pyarrow; the page maps, for the caller to look at."""
    data = path.read_bytes()
    table = pq.read_table(path)
    maps = []
    for leaf in leaves:
        want = expected(table, leaf)
        for chunk, first in chunks(path, leaf):
            pages = ChunkPages.scan(chunk, reader(data))
            for row in range(chunk.rows):
                got = pages.value(row, only(data, pages.ranges_for(row)))
                assert got == want[first + row], f"{leaf}, row {first + row}"
            assert pages.values(range(chunk.rows), reader(data)) == want[first : first + chunk.rows]
            maps.append(pages)
    return maps


def random_values(rng: np.random.Generator, rows: int, large: int) -> list[bytes | None]:
    """Sizes from 0 to ~300 KB, mostly small; nulls; repeats, so that dictionaries pay; bytes of 4
    bits each, so that every codec compresses them some."""
    values: list[bytes | None] = []
    for i in range(rows):
        pick = rng.random()
        if pick < 0.1:
            values.append(None)
        elif pick < 0.3 and values:
            values.append(values[int(rng.integers(len(values)))])
        else:
            top = 300_000 if i % max(rows // large, 1) == 0 else 3_000
            values.append(rng.integers(0, 16, int(rng.integers(0, top)), dtype=np.uint8).tobytes())
    values[1] = b""
    values[2] = rng.integers(0, 16, 300_000, dtype=np.uint8).tobytes()
    return values


def table_of(values: list[bytes | None]) -> pa.Table:
    # Half the struct column's nulls are null structs (level 0), half null bytes (level 1).
    structs = [
        None if v is None and i % 2 else {"bytes": v, "path": f"{i}.jpg"} for i, v in enumerate(values)
    ]
    return pa.table({"b": pa.array(values, pa.binary()), "s": pa.array(structs, STRUCT)})


@pytest.fixture(scope="module")
def sample() -> pa.Table:
    return table_of(random_values(np.random.default_rng(7), 160, 4))


@pytest.mark.parametrize("codec", CODECS)
def test_every_row_of_every_layout(tmp_path: Path, sample: pa.Table, codec: str) -> None:
    path = tmp_path / "t.parquet"
    for dictionary in (True, False):
        for version in ("1.0", "2.0"):
            for small_pages in (True, False):
                # pyarrow cuts pages, and checks the dictionary's size, once a write batch.
                small = {"data_page_size": 8 << 10, "write_batch_size": 4} if small_pages else {}
                pq.write_table(
                    sample,
                    path,
                    compression=codec,
                    use_dictionary=dictionary,
                    data_page_version=version,
                    row_group_size=64,
                    dictionary_pagesize_limit=64 << 10,
                    **small,
                )
                maps = check_file(path)
                assert len(maps) == 2 * 3
                encodings = {p.header.encoding for m in maps for p in m.pages}
                # The dictionary's size is checked between batches: default batches hold a group.
                assert (
                    encodings == ({RLE_DICTIONARY, PLAIN} if small_pages else {RLE_DICTIONARY})
                    if dictionary
                    else {PLAIN}
                )
                if small_pages:
                    assert max(len(m.pages) for m in maps) >= 8, [len(m.pages) for m in maps]


def test_the_dictionary_falls_back_to_plain_mid_chunk(tmp_path: Path) -> None:
    """At pyarrow's default limit: the dictionary page stops growing at 1 MiB."""
    rng = np.random.default_rng(3)
    distinct = [
        rng.integers(0, 16, int(rng.integers(20_000, 60_000)), dtype=np.uint8).tobytes() for _ in range(60)
    ]
    values: list[bytes | None] = [distinct[int(i)] for i in rng.integers(0, len(distinct), 400)]
    values[5] = None
    path = tmp_path / "t.parquet"
    pq.write_table(table_of(values), path, compression="zstd", write_batch_size=16)
    for pages in check_file(path):
        assert pages.dictionary is not None and pages.dictionary.header.kind == DICTIONARY_PAGE
        assert pages.dictionary.header.uncompressed_size > 1 << 19
        encodings = [p.header.encoding for p in pages.pages]
        assert encodings[0] == RLE_DICTIONARY and encodings[-1] == PLAIN
        row = pages.pages[0].first_row
        assert pages.ranges_for(row)[0] == (pages.dictionary.offset, pages.dictionary.length)
        assert len(pages.ranges_for(pages.pages[-1].first_row)) == 1


@pytest.mark.parametrize("codec", CODECS)
def test_pages_of_nulls_only_and_an_empty_row_group(tmp_path: Path, codec: str) -> None:
    values = [None] * 300 + [b"x" * 5000] * 3 + [None] * 50 + [b""] * 40
    path = tmp_path / "t.parquet"
    for version in ("1.0", "2.0"):
        small = {"data_page_size": 1024, "write_batch_size": 8, "row_group_size": 200}
        pq.write_table(table_of(values), path, compression=codec, data_page_version=version, **small)
        check_file(path)
    pq.write_table(table_of([]), path, compression=codec)
    assert [m.pages for m in check_file(path)] == [(), ()]


def test_a_file_the_datasets_library_wrote(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets is a test dependency (dev extra)")
    datasets.disable_progress_bars()
    rng = np.random.default_rng(5)
    encoded = []
    for i in range(40):
        picture = Image.fromarray(rng.integers(0, 256, (16 + i, 24, 3), dtype=np.uint8))
        out = io.BytesIO()
        picture.save(out, format="JPEG" if i % 2 else "PNG")
        encoded.append(out.getvalue())
    images: list[dict[str, Any] | None] = [{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(encoded)]
    images[3] = None
    rows = {"image": images, "label": list(range(len(images)))}
    dataset = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    path = tmp_path / "train.parquet"
    dataset.to_parquet(str(path))

    metadata = pq.read_metadata(path)
    features = json.loads(metadata.metadata[b"huggingface"])["info"]["features"]
    assert features["image"] == {"_type": "Image"}
    paths = [metadata.schema.column(c).path for c in range(metadata.num_columns)]
    assert paths == ["image.bytes", "image.path", "label"]
    assert metadata.schema.column(0).max_definition_level == 2  # a nullable struct, a nullable leaf
    (pages,) = check_file(path, ("image.bytes",))
    assert pages.values(range(len(images)), reader(path.read_bytes())) == [
        None if i is None else i["bytes"] for i in images
    ]


# --- Damage --------------------------------------------------------------------------------------


def read_everything(path_data: bytes, metadata: pq.FileMetaData, leaf: str) -> int:
    """Scans and reads every chunk of ``leaf`` from ``path_data``; how many raised ParquetPageError
    (any other exception fails the test)."""
    c = column_index(metadata, leaf)
    failed = 0
    for g in range(metadata.num_row_groups):
        chunk = chunk_of(metadata, g, c)
        try:
            pages = ChunkPages.scan(chunk, reader(path_data))
            values = pages.values(range(chunk.rows), reader(path_data))
            assert all(v is None or isinstance(v, bytes) for v in values)
        except ParquetPageError as e:
            assert str(e)
            failed += 1
    return failed


def written(tmp_path: Path, **options: object) -> tuple[bytes, pq.FileMetaData]:
    path = tmp_path / "d.parquet"
    values = random_values(np.random.default_rng(11), 120, 3)
    # No page statistics: random damage to them would go unseen (they are skipped), and crowd out the rest.
    small = {
        "row_group_size": 50,
        "data_page_size": 4 << 10,
        "write_batch_size": 4,
        "write_statistics": False,
    }
    pq.write_table(table_of(values), path, **small, **options)
    return path.read_bytes(), pq.read_metadata(path)


def test_a_truncated_file(tmp_path: Path) -> None:
    data, metadata = written(tmp_path, compression="zstd")
    last = chunk_of(metadata, metadata.num_row_groups - 1, column_index(metadata, "s.bytes"))
    first = chunk_of(metadata, 0, column_index(metadata, "b"))
    # Before any chunk, at the end of the first one, inside a header, and in between.
    cuts = [
        *np.linspace(4, last.start + last.size - 1, 23).astype(int),
        first.start + 10,
        first.start + first.size - 1,
    ]
    for cut in cuts:
        assert sum(read_everything(data[:cut], metadata, leaf) for leaf in LEAVES), f"cut at {cut}"
        with pytest.raises(ParquetPageError, match="the file ends"):
            ChunkPages.scan(last, reader(data[:cut])).values(range(last.rows), reader(data[:cut]))


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes((value,))


def i32(field: int, value: int) -> tuple[int, int, bytes]:
    return field, 5, varint((value << 1) ^ (value >> 63))  # zigzag


def thrift(fields: list[tuple[int, int, bytes]]) -> bytes:
    """A compact-protocol struct: (field id, compact type, encoded value) each."""
    out, last = bytearray(), 0
    for field, ctype, value in fields:
        delta = field - last
        head = bytes((delta << 4 | ctype,)) if 0 < delta <= 15 else bytes((ctype,)) + varint(field << 1)
        out += head + value
        last = field
    return bytes(out) + b"\0"


def data_page_header(
    compressed: int, uncompressed: int, values: int, *extra: tuple[int, int, bytes]
) -> bytes:
    page = thrift([i32(1, values), i32(2, PLAIN), i32(3, 3), i32(4, 3)])
    return thrift([i32(1, 0), i32(2, uncompressed), i32(3, compressed), *extra, (5, 12, page)])


def scan_bytes(
    blob: bytes, rows: int = 4, codec: str = "UNCOMPRESSED", max_def: int = 1
) -> list[bytes | None]:
    pages = ChunkPages.scan(Chunk(0, len(blob), codec, rows, max_def, 0), reader(blob))
    return pages.values(range(rows), reader(blob))


def plain_body(values: list[bytes]) -> bytes:
    """A version 1 page's body: the levels' length, one RLE run of 'present', the PLAIN values."""
    levels = varint(len(values) << 1) + b"\x01"
    return struct.pack("<I", len(levels)) + levels + b"".join(struct.pack("<I", len(v)) + v for v in values)


def plain_page(values: list[bytes], *extra: tuple[int, int, bytes]) -> bytes:
    body = plain_body(values)
    return data_page_header(len(body), len(body), len(values), *extra) + body


def test_hand_made_pages_read_back() -> None:
    """The pages that the damage below starts from are good ones."""
    assert scan_bytes(plain_page([b"a", b"", b"xyz", b"q"])) == [b"a", b"", b"xyz", b"q"]


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (data_page_header(0x7FFFFFFF, 100, 4) + bytes(100), "compressed size 2147483647 is outside"),
        (data_page_header(100, 1 << 40, 4) + bytes(100), "uncompressed size 1099511627776 is outside"),
        (data_page_header(-5, 100, 4) + bytes(100), "compressed size -5"),
        (data_page_header(200_000, 200_000, 4) + bytes(100), "run past the chunk's end"),
        (data_page_header(10, 10, -1) + bytes(10), "num_values -1"),
        (data_page_header(10, 10, 9) + bytes(10), "more than the row group's 4 rows"),
        (data_page_header(30, 30, 4)[:-3], "page header at 0: runs past 14 bytes"),
        (thrift([i32(1, 0), i32(2, 10)]) + bytes(10), "no compressed_page_size"),
        (thrift([i32(1, 7), i32(2, 10), i32(3, 10)]) + bytes(10), "unknown page type 7"),
        (b"\x15" + b"\xff" * 11, "varint longer than 10 bytes"),
        (b"\x1c" * 40 + b"\0" * 40, "nested more than 16 deep"),
        (thrift([(1, 9, b"\xf1" + varint(20_000) + b"\x01" * 20_000)]), "more than 10000 values"),
        (thrift([(1, 9, b"\xf8" + varint(1 << 30))]) + bytes(10), "container of 1073741824 items"),
        (thrift([(1, 8, varint(1 << 40))]) + bytes(10), "a field of 1099511627776 bytes"),
        (b"\x1d\x00", "unknown compact type 13"),
    ],
)
def test_damaged_headers(blob: bytes, reason: str) -> None:
    with pytest.raises(ParquetPageError, match=reason):
        scan_bytes(blob)


def test_a_header_longer_than_the_first_read() -> None:
    """A field the reader skips (as statistics with long values) past the first 1 KiB read."""
    skipped = (7, 8, varint(5000) + bytes(5000))  # a binary field: PageHeader has none
    assert scan_bytes(plain_page([b"a", b"b", b"c", b"d"], skipped)) == [b"a", b"b", b"c", b"d"]


def with_bytes(body: bytes, at: int, new: bytes) -> bytes:
    return body[:at] + new + body[at + len(new) :]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # "qwert"'s length, the last 4 bytes before it
        (
            lambda body: with_bytes(body, len(body) - 9, struct.pack("<I", 0xFFFFFFF0)),
            "value 3 of 4294967280",
        ),
        (lambda body: with_bytes(body, 0, struct.pack("<I", 1 << 20)), "levels of 1048576 bytes"),
        (lambda body: with_bytes(body, 4, b"\x00"), "a run of no values"),
        (lambda body: with_bytes(body, 4, b"\x80"), "ends inside a run at byte 2"),  # 64 values
        (lambda body: with_bytes(body, 5, b"\x02"), "run value 2 is wider than 1 bits"),
        (lambda body: with_bytes(body, 4, b"\x06"), "ends before all its values"),  # 3 levels, 4 rows
    ],
)
def test_damaged_page_bodies(change: Callable[[bytes], bytes], reason: str) -> None:
    body = change(plain_body([b"a", b"", b"xyz", b"qwert"]))
    with pytest.raises(ParquetPageError, match=reason):
        scan_bytes(data_page_header(len(body), len(body), 4) + body)


def test_bad_chunks_are_refused() -> None:
    blob = plain_page([b"a"])
    with pytest.raises(ParquetPageError, match="lists are not supported"):
        ChunkPages.scan(Chunk(0, len(blob), "UNCOMPRESSED", 1, 1, 1), reader(blob))
    with pytest.raises(ParquetPageError, match="codec 'LZO'"):
        ChunkPages.scan(Chunk(0, len(blob), "LZO", 1, 1, 0), reader(blob))
    with pytest.raises(ParquetPageError, match="pages hold 1 of 2 rows"):
        ChunkPages.scan(Chunk(0, len(blob), "UNCOMPRESSED", 2, 1, 0), reader(blob))


def test_a_crc_catches_any_changed_byte(tmp_path: Path) -> None:
    data, metadata = written(tmp_path, compression="none", write_page_checksum=True)
    chunk = chunk_of(metadata, 0, column_index(metadata, "b"))
    pages = ChunkPages.scan(chunk, reader(data))
    rng = np.random.default_rng(2)
    for page in rng.choice(np.array(pages.pages, dtype=object), 10):
        at = page.offset + page.header_size + int(rng.integers(page.header.compressed_size))
        damaged = data[:at] + bytes((data[at] ^ 0x20,)) + data[at + 1 :]
        with pytest.raises(ParquetPageError, match="CRC mismatch"):
            pages.value(page.first_row, reader(damaged))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_random_damage_is_a_parquet_page_error(tmp_path: Path, codec: str, version: str) -> None:
    """Bytes changed in headers, levels, lengths, compressed streams, anywhere in the chunks. What
    cannot be told from good data (an image's own bytes, stored uncompressed) reads; all else must
    raise ParquetPageError, and nothing may raise anything else."""
    data, metadata = written(
        tmp_path, compression=codec, data_page_version=version, dictionary_pagesize_limit=8192
    )
    pages = [
        page
        for leaf in LEAVES
        for g in range(metadata.num_row_groups)
        for m in [ChunkPages.scan(chunk_of(metadata, g, column_index(metadata, leaf)), reader(data))]
        for page in (*m.pages, *([m.dictionary] if m.dictionary else []))
    ]
    rng = np.random.default_rng(len(codec) * 10 + len(version))
    failed = 0
    for attempt in range(80):
        damaged = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            page = pages[int(rng.integers(len(pages)))]
            # Mostly near a page's start: its header, its levels, its first value's length.
            span = page.length if attempt % 4 == 0 else min(page.length, page.header_size + 24)
            damaged[page.offset + int(rng.integers(span))] = int(rng.integers(256))
        failed += sum(read_everything(bytes(damaged), metadata, leaf) for leaf in LEAVES)
    assert failed > 80 * 2 // 3, failed


def test_hybrid_streams_of_every_width() -> None:
    """Levels and dictionary indices from RLE and bit-packed runs, against a plain decode."""
    rng = np.random.default_rng(9)
    for width in range(17):
        top = int(rng.integers(1 << (width - 1), 1 << width)) if width else 0  # its width is ``width``
        stream, values = bytearray(), list[int]()
        while len(values) < 3000:
            if rng.random() < 0.5:
                run = [int(rng.integers(top + 1))] * int(rng.integers(1, 300))
                stream += varint(len(run) << 1) + run[0].to_bytes((width + 7) // 8, "little")
            else:
                groups = int(rng.integers(1, 40))
                run = [int(v) for v in rng.integers(0, top + 1, groups * 8)]
                bits = np.array([(v >> b) & 1 for v in run for b in range(width)], dtype=np.uint8)
                stream += varint(groups << 1 | 1) + np.packbits(bits, bitorder="little").tobytes()
            values += run
        positions = sorted({int(p) for p in rng.integers(0, len(values), 50)} | {len(values) - 1})
        indices = indices_at(memoryview(bytes((width,)) + stream), positions, "indices")
        assert indices == [values[p] for p in positions]
        if top:
            levels = levels_at(memoryview(bytes(stream)), top, positions, "levels")
            full = np.array(values) == top
            assert levels == [(bool(full[p]), int(np.count_nonzero(full[:p]))) for p in positions]
    with pytest.raises(ParquetPageError, match="4 levels above the maximum 2"):
        levels_at(memoryview(varint(5 << 1) + b"\x03"), 2, [4], "levels")
    with pytest.raises(ParquetPageError, match="7 levels above the maximum 2"):
        levels_at(memoryview(varint(1 << 1 | 1) + b"\xff\xff"), 2, [7], "levels")


# --- work bounded by the bytes, not by numbers the file makes up (NOTE [ Untrusted pages ]) --------


def null_page(rows: int, values: list[bytes]) -> bytes:
    """A valid version 1 page: ``rows`` nulls in one RLE run, then ``values`` present."""
    levels = varint(rows << 1) + b"\x00" + varint(len(values) << 1) + b"\x01"
    body = struct.pack("<I", len(levels)) + levels + b"".join(struct.pack("<I", len(v)) + v for v in values)
    return data_page_header(len(body), len(body), rows + len(values)) + body


@pytest.mark.parametrize("raw", [True, False], ids=["span", "value"])
def test_millions_of_null_rows_cost_a_few_runs(raw: bool) -> None:
    """One page of 4,000,000 nulls and one value, 30 bytes of levels: what pyarrow reads in a blink
    took seconds and 400 MB when the page's rows were listed one by one."""
    rows = 4_000_000
    blob = null_page(rows, [b"image"])
    pages = ChunkPages.scan(Chunk(0, len(blob), "UNCOMPRESSED", rows + 1, 1, 0), reader(blob))
    tracemalloc.start()
    try:
        if raw:
            assert pages.stored_raw(0)
            assert pages.span(0, reader(blob)) is None and pages.span(rows - 1, reader(blob)) is None
            offset, size = pages.span(rows, reader(blob)) or (0, 0)
            assert blob[offset : offset + size] == b"image"
        else:
            assert pages.values([0, rows - 1, rows], reader(blob)) == [None, None, b"image"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.0f} MiB for a page of {len(blob)} bytes"


def test_header_reads_follow_the_last_header_not_the_largest() -> None:
    """One header with 40 KB of skipped fields, then 2,000 small pages: each small header is read
    with about 1 KiB again, not with twice the large one."""
    skipped = (7, 8, varint(40_000) + bytes(40_000))
    blob = plain_page([b"a"], skipped) + b"".join(plain_page([b"b"]) for _ in range(2000))
    read: list[int] = []

    def counting(offset: int, size: int) -> bytes:
        read.append(size)
        return blob[offset : offset + size]

    pages = ChunkPages.scan(Chunk(0, len(blob), "UNCOMPRESSED", 2001, 1, 0), counting)
    assert len(pages.pages) == 2001
    assert sum(read) < 2001 * 2 * 1024 + 200_000, f"{sum(read) / 2**20:.1f} MiB read for the headers"


def damaged_tail_page(tail: bytes) -> bytes:
    """Four values and then ``tail``: bytes the page's header counts but no value accounts for."""
    values = [b"first", b"second", b"third", b"fourth"]
    levels = varint(4 << 1) + b"\x01"
    body = struct.pack("<I", len(levels)) + levels + b"".join(struct.pack("<I", len(v)) + v for v in values)
    body += tail
    return data_page_header(len(body), len(body), 4) + body


@pytest.mark.parametrize("raw", [True, False], ids=["span", "value"])
def test_no_row_is_served_from_a_page_damaged_further_on(raw: bool) -> None:
    """The first rows of a page are intact and the damage lies past them: every row of it is
    refused, as pyarrow refuses the page whole, and the verdict stays with the page map."""
    blob = damaged_tail_page(b"\x07\x00")
    pages = ChunkPages.scan(Chunk(0, len(blob), "UNCOMPRESSED", 4, 1, 0), reader(blob))
    for row in range(4):
        with pytest.raises(ParquetPageError, match="bytes after its 4 values"):
            if raw:
                pages.span(row, reader(blob))
            else:
                pages.value(row, reader(blob))
    good = damaged_tail_page(b"")
    again = ChunkPages.scan(Chunk(0, len(good), "UNCOMPRESSED", 4, 1, 0), reader(good))
    assert again.values(range(4), reader(good)) == [b"first", b"second", b"third", b"fourth"]


@pytest.mark.parametrize("codec", ["none", "snappy"])
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_no_row_is_served_that_pyarrow_would_not_give(tmp_path: Path, codec: str, version: str) -> None:
    """A differential fuzz: a bit flipped in a page's last quarter (past its first rows), 150 times,
    in dictionary-encoded and PLAIN pages. Each row, read alone as a worker reads it, is refused,
    or is the row's own value, or is changed only where pyarrow reads the same changed value (an
    image's own bytes, stored raw, which nothing can tell from good ones): never bytes pyarrow
    refuses, never another row's image."""
    data, metadata = written(
        tmp_path, compression=codec, data_page_version=version, dictionary_pagesize_limit=8192
    )
    leaf = "b"
    c = column_index(metadata, leaf)
    chunk_list = [chunk_of(metadata, g, c) for g in range(metadata.num_row_groups)]
    original = [
        ChunkPages.scan(chunk, reader(data)).values(range(chunk.rows), reader(data)) for chunk in chunk_list
    ]
    pages = [page for chunk in chunk_list for page in ChunkPages.scan(chunk, reader(data)).pages]
    rng = np.random.default_rng(len(codec) + len(version))
    path = tmp_path / "damaged.parquet"
    wrong: list[str] = []
    for _ in range(150):
        page = pages[int(rng.integers(len(pages)))]
        at = page.offset + page.length - 1 - int(rng.integers(max(1, page.header.compressed_size // 4)))
        damaged = bytearray(data)
        damaged[at] ^= 1 << int(rng.integers(8))
        path.write_bytes(damaged)
        for g, chunk in enumerate(chunk_list):
            try:
                mapped = ChunkPages.scan(chunk, reader(bytes(damaged)))
            except ParquetPageError:
                continue
            for row in range(chunk.rows):
                try:
                    got = mapped.value(row, reader(bytes(damaged)))
                except ParquetPageError:
                    continue
                if got != original[g][row] and got != pyarrow_row(path, g, leaf, row):
                    wrong.append(f"byte {at}: row {row} of group {g}")
    assert wrong == []


def pyarrow_row(path: Path, group: int, leaf: str, row: int) -> object:
    """What pyarrow reads at ``row`` of ``group``, or a marker no value equals where it refuses."""
    try:
        return pq.ParquetFile(path).read_row_group(group, columns=[leaf]).column(0)[row].as_py()
    except Exception:  # refused: nothing it gives can match
        return object()
