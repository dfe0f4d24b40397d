"""The Parquet format's part of the index: where each sample's image lies, row group by row group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.formats.parquet.pagemodel import Chunk
from loader_service.dataset.tables import (
    I64,
    ListMetadata,
)


@dataclass(frozen=True)
class ParquetRows:
    """Where each row's image lies: its row group (an id over all files) and its row in that group;
    per group, its file and the image column's chunk (``pagemodel.Chunk``)."""

    files: tuple[str, ...]
    codecs: tuple[str, ...]
    max_def: int
    sample_group: npt.NDArray[np.int32]
    sample_row: npt.NDArray[np.int32]
    group_file: npt.NDArray[np.int32]
    group_start: I64
    group_size: I64
    group_rows: I64
    group_codec: npt.NDArray[np.uint8]
    metadata: ListMetadata | None = None

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        arrays: dict[str, npt.NDArray[Any]] = {
            "pq_sample_group": self.sample_group,
            "pq_sample_row": self.sample_row,
            "pq_group_file": self.group_file,
            "pq_group_start": self.group_start,
            "pq_group_size": self.group_size,
            "pq_group_rows": self.group_rows,
            "pq_group_codec": self.group_codec,
        }
        if self.metadata is not None:
            arrays |= self.metadata.arrays
        return arrays

    def describe(self) -> dict[str, Any]:
        facts = {"files": list(self.files), "codecs": list(self.codecs), "max_def": self.max_def}
        return {"parquet": facts, **(self.metadata.describe() if self.metadata is not None else {})}

    def chunk(self, group: int) -> Chunk:
        return Chunk(
            start=int(self.group_start[group]),
            size=int(self.group_size[group]),
            codec=self.codecs[int(self.group_codec[group])],
            rows=int(self.group_rows[group]),
            max_def=self.max_def,
            max_rep=0,
        )


class RowGroups:
    """What a scan accumulates, file by file."""

    def __init__(self) -> None:
        self.codecs: list[str] = []
        self.file: list[int] = []
        self.start: list[int] = []
        self.size: list[int] = []
        self.rows: list[int] = []
        self.codec: list[int] = []

    def add(self, file: int, chunk: Chunk) -> None:
        if chunk.codec not in self.codecs:
            self.codecs.append(chunk.codec)
        self.file.append(file)
        self.start.append(chunk.start)
        self.size.append(chunk.size)
        self.rows.append(chunk.rows)
        self.codec.append(self.codecs.index(chunk.codec))
