"""Where each sample of a zip archive lies, and how it is stored: the zip format's part of the index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.tables import I64


@dataclass(frozen=True)
class ZipMembers:
    """Per sample, in the index's order: its member's local header offset, compressed and
    uncompressed sizes, CRC-32, compression method and the central directory's name and extra
    lengths (what its local header probably adds). 33 bytes a sample, beside its name."""

    archive: str
    """The archive, relative to the index's root (or the store folder)."""
    offset: I64
    compressed: I64
    size: I64
    crc: npt.NDArray[np.uint32]
    method: npt.NDArray[np.uint8]
    header: npt.NDArray[np.uint32]

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {
            "zip_offset": self.offset,
            "zip_compressed": self.compressed,
            "zip_size": self.size,
            "zip_crc": self.crc,
            "zip_method": self.method,
            "zip_header": self.header,
        }

    def describe(self) -> dict[str, Any]:
        return {"zip": {"archive": self.archive}}
