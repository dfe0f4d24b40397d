"""A TFRecord sample's image: its record's data and checksum in one ranged read, the checksum
checked, the image sliced out where the scan found it (NOTE [ TFRecord framing ])."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from loader_service.dataset.format import Metadata
from loader_service.dataset.formats.tfrecord.crc import masked
from loader_service.dataset.formats.tfrecord.framing import FOOTER
from loader_service.dataset.formats.tfrecord.records import TFRecords
from loader_service.dataset.storage.local import Files
from loader_service.dataset.tables import StringTable
from protocol.pixels import DecodeError


class TFRecordReader:
    """Records read in place, from the local disk or an object store."""

    def __init__(self, files: Files, names: StringTable, records: TFRecords, max_bytes: int) -> None:
        self.files = files
        self.names = names
        self.records = records
        self.max_bytes = max_bytes

    def image_bytes(self, i: int) -> bytes:
        r = self.records
        name, (where, offset, size) = self.names.text(i), self._where(i)
        if size - FOOTER > self.max_bytes:
            raise DecodeError(
                f"record {name} of {size - FOOTER} bytes is over --max-file-bytes {self.max_bytes}"
            )
        try:
            data = self.files.read_range(where, offset, size)
        except OSError as exc:
            raise DecodeError(f"cannot read record {name}: {exc.strerror or exc}") from None
        if len(data) < size:
            raise DecodeError(f"record {name} runs past the end of {where} ({len(data)} of {size} bytes)")
        body = memoryview(data)[: size - FOOTER]
        if masked(body) != struct.unpack_from("<I", data, size - FOOTER)[0]:
            raise DecodeError(f"record {name}: CRC-32C mismatch (the file is damaged)")
        start = int(r.image_offset[i])
        return bytes(body[start : start + int(r.image_length[i])])

    def metadata(self, i: int) -> Metadata:
        return {}

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask for the records of ``indices`` at once (NOTE [ Object store reads ])."""
        self.files.prefetch(
            [self._where(i) for i in indices if int(self.records.length[i]) <= self.max_bytes]
        )

    def close(self) -> None:
        self.files.close()

    def _where(self, i: int) -> tuple[str, int, int]:
        r = self.records
        return r.files[int(r.sample_file[i])], int(r.offset[i]), int(r.length[i]) + FOOTER
