"""Decompressing a page, each codec made to prove it wrote exactly the size the header gives (NOTE
[ Untrusted pages ] in ``pages``)."""

from __future__ import annotations

import zlib

from loader_service.dataset.formats.parquet.pagemodel import (
    HADOOP_BLOCK,
    MAX_HADOOP_BLOCKS,
    ParquetPageError,
)


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
        out_size, in_size = HADOOP_BLOCK.unpack_from(data, pos)
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
