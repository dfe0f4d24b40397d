"""The Parquet source: the files Hugging Face ``datasets`` writes (``Dataset.to_parquet``, every image
dataset on the hub), or any table with a binary image column. Needs pyarrow (``dataferry[parquet]``).

``--data`` is a ``.parquet`` file, a folder of them (sorted by name), or a brace pattern; local or in
an object store. Sample ``i`` is row ``i`` across the files in order. The image column
(``--image-column``; default the one ``datasets`` marks as an ``Image`` in the schema's
``huggingface`` metadata, else ``image``) is a struct of ``bytes`` and ``path`` or plain binary; the
label column (``--label-column``, default ``label``) holds integers (null: -1; absent: every label
-1), and a ``ClassLabel``'s names become the classes. Every other column is metadata handed to a
pipeline, as the JSON value of the row's cell (binary columns are left out).

NOTE [ Parquet reads ]: the index comes from the footers (row groups, where the image column's chunk
of each lies) and the label and metadata columns: no image byte is read at start. pyarrow can only
decode a whole row group's column (``datasets`` writes 100 images a group), so a worker reads just
the data page holding its row (``pages``: the page headers of a chunk are read once, then each
image costs its page, plus the dictionary page while pyarrow's dictionary encoding lasts). In an
object store the files are fetched once into the cache folder at start when there is one (as
``datasets`` itself caches files), else read by range.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loader_service.dataset.format import (
    Columns,
    Format,
    Indexed,
    IndexPart,
    Mapped,
    Progress,
    Scanned,
)
from loader_service.dataset.formats.parquet.reader import ParquetReader
from loader_service.dataset.formats.parquet.rows import ParquetRows
from loader_service.dataset.formats.parquet.scan import ParquetScan
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_files, local_named
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.patterns import is_brace_pattern
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import (
    ListMetadata,
    StringTable,
)

SUFFIX = ".parquet"


def local_files(data: str | Path) -> tuple[Path, tuple[str, ...]]:
    """The root folder and the files relative to it, in row order; each must exist."""
    return local_named(Path(data), SUFFIX, ".parquet files")


class ParquetFormat:
    """``--format parquet`` (``dataset.format.Format``)."""

    name = "parquet"
    what = "a .parquet file, a folder of them or a brace pattern"
    holds = ".parquet files"
    in_store = "folder"

    def claims_folder(self, root: Path) -> bool:
        with os.scandir(root) as it:
            return any(e.name.endswith(SUFFIX) for e in it)

    def claims_file(self, name: str) -> bool:
        return name.endswith(SUFFIX)

    def claims_pattern(self, text: str) -> bool:
        return is_brace_pattern(text) and text.endswith(SUFFIX)

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        listing = list_files(data, SUFFIX, "Parquet files", local_files)
        found = ParquetScan(columns, progress)
        with contextlib.closing(listing.sources()) as sources:  # a failed scan's fetched files go now
            for k, (name, source) in enumerate(sources):
                found.add(k, name, source, listing.where(name))
        return found.scanned(listing.names, listing.root, listing.url, listing.versions())

    def inputs(self, data: Location) -> Any:
        return list_files(data, SUFFIX, "Parquet files", local_files).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        facts = described["parquet"]
        listed = described.get("metadata")
        return ParquetRows(
            files=tuple(facts["files"]),
            codecs=tuple(facts["codecs"]),
            max_def=int(facts["max_def"]),
            sample_group=mapped("pq_sample_group"),
            sample_row=mapped("pq_sample_row"),
            group_file=mapped("pq_group_file"),
            group_start=mapped("pq_group_start"),
            group_size=mapped("pq_group_size"),
            group_rows=mapped("pq_group_rows"),
            group_codec=mapped("pq_group_codec"),
            metadata=None
            if listed is None
            else ListMetadata(
                listed["style"],
                tuple(listed["columns"]),
                StringTable(mapped("metadata_offsets"), mapped("metadata_blob")),
            ),
        )

    def relpath(self, index: Indexed, i: int) -> str:
        return index.names.text(i)

    def path(self, index: Indexed, i: int) -> Path:
        rows = _rows(index)
        return index.root / rows.files[int(rows.group_file[int(rows.sample_group[i])])]

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> ParquetReader:
        return ParquetReader(
            open_files(index, storage, max_bytes, heard), _rows(index), max_bytes, exact=True
        )


def _rows(index: Indexed) -> ParquetRows:
    assert isinstance(index.part, ParquetRows), "a parquet index holds its rows"
    return index.part


FORMAT: Format = ParquetFormat()
