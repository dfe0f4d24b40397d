"""A ``save_to_disk`` sample's image: one ranged read of its bytes where the scan found them."""

from __future__ import annotations

from collections.abc import Sequence

from loader_service.dataset.format import Metadata
from loader_service.dataset.formats.arrow.rows import ArrowRows
from loader_service.dataset.storage.local import Files
from loader_service.dataset.tables import StringTable
from protocol.pixels import DecodeError


class ArrowReader:
    """Images read in place, from the local disk or an object store: one that is over
    ``--max-file-bytes`` is refused before it is read, one cut short by its file's end is a bad
    sample."""

    def __init__(self, files: Files, names: StringTable, rows: ArrowRows, max_bytes: int) -> None:
        self.files = files
        self.names = names
        self.rows = rows
        self.max_bytes = max_bytes

    def image_bytes(self, i: int) -> bytes:
        name, where, offset, size = self.names.text(i), *self._where(i)
        if size > self.max_bytes:
            raise DecodeError(f"image of row {name}: {size} bytes is over --max-file-bytes {self.max_bytes}")
        try:
            data = self.files.read_range(where, offset, size)
        except OSError as exc:
            raise DecodeError(f"cannot read row {name}: {exc.strerror or exc}") from None
        if len(data) < size:
            raise DecodeError(
                f"image of row {name} runs past the end of {where} ({len(data)} of {size} bytes)"
            )
        return data

    def metadata(self, i: int) -> Metadata:
        return {}

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask for the images of ``indices`` at once (NOTE [ Object store reads ])."""
        self.files.prefetch([self._where(i) for i in indices if int(self.rows.size[i]) <= self.max_bytes])

    def close(self) -> None:
        self.files.close()

    def _where(self, i: int) -> tuple[str, int, int]:
        rows = self.rows
        return rows.files[int(rows.sample_file[i])], int(rows.offset[i]), int(rows.size[i])
