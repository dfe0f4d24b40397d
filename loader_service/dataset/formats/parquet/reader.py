"""Reading a sample's image from the one data page that holds it (``pages``), and its metadata."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from loader_service.dataset.format import (
    Metadata,
)
from loader_service.dataset.formats.filelist import listed_metadata
from loader_service.dataset.formats.parquet.pagemodel import ParquetPageError
from loader_service.dataset.formats.parquet.pages import ChunkPages
from loader_service.dataset.formats.parquet.rows import ParquetRows
from loader_service.dataset.storage.local import Files
from protocol.pixels import DecodeError

OPEN_CHUNKS = 256
"""Page maps a reader keeps (one per row group it read from): a few KiB each."""


class ParquetReader:
    """A row's image from the data page that holds it (NOTE [ Parquet reads ]); a null image or a
    damaged page is a bad sample."""

    def __init__(self, files: Files, rows: ParquetRows, max_bytes: int, exact: bool) -> None:
        self.files = files
        self.rows = rows
        self.max_bytes = max_bytes
        self.exact = exact
        """Read a value alone where the file is on this host (a few small reads per page first); a
        store is better asked for a whole page, once."""
        self._pages: OrderedDict[int, ChunkPages] = OrderedDict()

    def image_bytes(self, i: int) -> bytes:
        group, row = int(self.rows.sample_group[i]), int(self.rows.sample_row[i])
        read_at = self._reader_of(group)
        try:
            value = self._value(group, row, read_at)
        except ParquetPageError as exc:
            raise DecodeError(f"damaged Parquet page: {exc}") from None
        if value is None:
            raise DecodeError("the image is null")
        if len(value) > self.max_bytes:
            raise DecodeError(f"image of {len(value)} bytes is over --max-file-bytes {self.max_bytes}")
        if not value:
            raise DecodeError("the image is empty")
        return value

    def metadata(self, i: int) -> Metadata:
        return listed_metadata(self.rows.metadata, i)

    def prefetch(self, indices: Sequence[int]) -> None:
        """The pages of rows whose page maps are known, at once (NOTE [ Object store reads ])."""
        wanted = []
        for i in indices:
            group = int(self.rows.sample_group[i])
            pages = self._pages.get(group)
            if pages is not None:
                wanted += [
                    (self._file(group), off, size)
                    for off, size in pages.ranges_for(int(self.rows.sample_row[i]))
                ]
        self.files.prefetch(wanted)

    def close(self) -> None:
        self.files.close()

    def _value(self, group: int, row: int, read_at: Callable[[int, int], bytes]) -> bytes | None:
        """The row's bytes alone where its page keeps them as they are (what ``datasets`` writes for
        images) and the file is on this host, else from its whole page (NOTE [ Parquet reads ])."""
        pages = self._pages_of(group)
        if not (self.exact and self.files.is_local(self._file(group)) and pages.stored_raw(row)):
            return pages.value(row, read_at)
        span = pages.span(row, read_at)
        if span is None:
            return None
        offset, size = span
        if size > self.max_bytes:
            raise DecodeError(f"image of {size} bytes is over --max-file-bytes {self.max_bytes}")
        data = read_at(offset, size)
        if len(data) != size:
            raise DecodeError(f"the file ends inside the image ({len(data)} of {size} bytes)")
        return data

    def _file(self, group: int) -> str:
        return self.rows.files[int(self.rows.group_file[group])]

    def _reader_of(self, group: int) -> Callable[[int, int], bytes]:
        name = self._file(group)

        def read_at(offset: int, size: int) -> bytes:
            try:
                return self.files.read_range(name, offset, size)
            except OSError as exc:
                raise DecodeError(f"cannot read {name}: {exc.strerror or exc}") from None

        return read_at

    def _pages_of(self, group: int) -> ChunkPages:
        pages = self._pages.get(group)
        if pages is not None:
            self._pages.move_to_end(group)
            return pages
        pages = self._pages[group] = ChunkPages.scan(self.rows.chunk(group), self._reader_of(group))
        if len(self._pages) > OPEN_CHUNKS:
            self._pages.popitem(last=False)
        return pages
