"""Where each sample of a set of TFRecord files lies: the tfrecord format's part of the index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.tables import I64


@dataclass(frozen=True)
class TFRecords:
    """Per sample, in record order across the files: its file, its record's data offset and length,
    and its image's offset and length within the record (36 bytes a sample, beside its name)."""

    files: tuple[str, ...]
    sample_file: npt.NDArray[np.int32]
    offset: I64
    length: I64
    image_offset: I64
    image_length: I64

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {
            "tfr_file": self.sample_file,
            "tfr_offset": self.offset,
            "tfr_length": self.length,
            "tfr_image_offset": self.image_offset,
            "tfr_image_length": self.image_length,
        }

    def describe(self) -> dict[str, Any]:
        return {"tfrecord": {"files": list(self.files)}}
