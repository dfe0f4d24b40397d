"""Where each image of a ``save_to_disk`` folder lies: the arrow format's part of the index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.tables import I64


@dataclass(frozen=True)
class ArrowRows:
    """Per sample, in row order across the files: its file, and its image's bytes' offset and
    length in that file (20 bytes a sample, beside its name)."""

    files: tuple[str, ...]
    """The ``data-*.arrow`` files in ``state.json``'s order, relative to the folder."""
    sample_file: npt.NDArray[np.int32]
    offset: I64
    size: I64

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {"arrow_file": self.sample_file, "arrow_offset": self.offset, "arrow_size": self.size}

    def describe(self) -> dict[str, Any]:
        return {"arrow": {"files": list(self.files)}}
