"""Indexing Parquet files from their footers and their label and metadata columns (NOTE [ Parquet
reads ] in ``source``): no image byte is read."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.format import (
    Columns,
    Progress,
    Scanned,
)
from loader_service.dataset.formats.features import hf_features, is_binary, is_image
from loader_service.dataset.formats.parquet.pagemodel import Chunk
from loader_service.dataset.formats.parquet.rows import ParquetRows, RowGroups
from loader_service.dataset.tables import (
    I64,
    DatasetError,
    ListMetadata,
    StringTableBuilder,
)

NO_LABEL = -1
MAX_ROWS_PER_FILE = 1 << 31
"""Rows of one file: a row's place in its group is an int32."""


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("reading Parquet needs pyarrow: pip install 'dataferry[parquet]'") from None
    return pq


@dataclass(frozen=True)
class _Layout:
    """Where a file's image and label are, as its schema says."""

    leaf: int
    """The image bytes' leaf column (``image.bytes``, or ``image`` when binary)."""
    max_def: int
    label: str | None
    classes: tuple[str, ...]
    others: tuple[str, ...]


def _layout(pf: Any, columns: Columns, where: str) -> _Layout:
    schema = pf.schema_arrow
    features = hf_features(schema.metadata or {}, where)
    image = columns.image or next((k for k, v in features.items() if is_image(v)), "image")
    if image not in schema.names:
        raise DatasetError(f"{where} has no image column {image!r} (columns: {', '.join(schema.names)}); "
                           "say which with --image-column")  # fmt: skip
    path = _image_leaf(schema.field(image), image, where)
    md = pf.metadata.schema
    leaf = next((j for j in range(len(md)) if md.column(j).path == path), None)
    if leaf is None or md.column(leaf).max_repetition_level != 0:
        raise DatasetError(f"{where}: the image column {image!r} is not a binary value a row")
    label = columns.label if columns.label in schema.names else None
    feature = features.get(label or "", {})
    classes = tuple(feature.get("names") or ()) if isinstance(feature, dict) else ()
    # Bytes (a second image, a mask) would be read whole at start and kept as text: left out.
    skipped = {n for n in schema.names if _holds_binary(schema.field(n).type) or is_image(features.get(n))}
    others = tuple(n for n in schema.names if n not in (image, label) and n not in skipped)
    return _Layout(leaf, md.column(leaf).max_definition_level, label, classes, others)


def _image_leaf(field: Any, name: str, where: str) -> str:
    import pyarrow as pa

    if is_binary(field.type):
        return name
    struct = pa.types.is_struct(field.type) and field.type.get_field_index("bytes") >= 0
    if struct and is_binary(field.type.field("bytes").type):
        return f"{name}.bytes"
    raise DatasetError(f"{where}: column {name!r} is {field.type}, not binary nor a struct of bytes and path")


def _holds_binary(kind: Any) -> bool:
    """Is ``kind`` binary, or a struct or list with binary inside?"""
    import pyarrow as pa

    if is_binary(kind):
        return True
    if pa.types.is_struct(kind):
        return any(_holds_binary(kind.field(k).type) for k in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _holds_binary(kind.value_type)
    return False


class ParquetScan:
    """Rows, labels, names and metadata of each file in turn."""

    def __init__(self, columns: Columns, progress: Progress | None) -> None:
        self.columns = columns
        self.progress = progress
        self.groups = RowGroups()
        self.sample_group: list[npt.NDArray[np.int32]] = []
        self.sample_row: list[npt.NDArray[np.int32]] = []
        self.labels: list[I64] = []
        self.names = StringTableBuilder()
        self.metadata = StringTableBuilder()
        self.layout: _Layout | None = None
        self.rows = 0

    def add(self, k: int, name: str, source: Any, where: str) -> None:
        pq = _pq()
        try:
            pf = pq.ParquetFile(source)
            layout = _layout(pf, self.columns, where)
            self._same_layout(layout, where)
            self._groups(k, pf.metadata, layout, where)
            self._columns(pf, layout, name, where)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DatasetError(f"{where}: not a readable Parquet file: {exc}") from None

    def _groups(self, k: int, md: Any, layout: _Layout, where: str) -> None:
        counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        if sum(counts) != md.num_rows or not 0 <= md.num_rows <= MAX_ROWS_PER_FILE:
            raise DatasetError(f"{where}: its footer's row counts disagree ({sum(counts)} and {md.num_rows})")
        for g, rows in enumerate(counts):
            self.groups.add(k, _chunk(md.row_group(g).column(layout.leaf), rows, layout.max_def))
            self.sample_group.append(np.full(rows, len(self.groups.file) - 1, np.int32))
            self.sample_row.append(np.arange(rows, dtype=np.int32))

    def _same_layout(self, layout: _Layout, where: str) -> None:
        if self.layout is None:
            self.layout = layout
        elif (layout.max_def, layout.label, layout.others) != (
            self.layout.max_def,
            self.layout.label,
            self.layout.others,
        ):
            raise DatasetError(f"{where}: its columns differ from the first file's")  # fmt: skip

    def _columns(self, pf: Any, layout: _Layout, name: str, where: str) -> None:
        wanted = [c for c in (layout.label, *layout.others) if c]
        table = pf.read(columns=wanted) if wanted else None
        rows = pf.metadata.num_rows
        if table is not None and table.num_rows != rows:
            raise DatasetError(f"{where}: {table.num_rows} rows read where its footer says {rows}")
        self.labels.append(
            _labels(table.column(layout.label) if table is not None and layout.label else None, rows)
        )
        for r in range(rows):
            self.names.add(f"{name}:{r}".encode("utf-8", "surrogateescape"))
        if table is not None and layout.others:
            cells = [table.column(c).to_pylist() for c in layout.others]
            for values in zip(*cells, strict=True):
                self.metadata.add(
                    json.dumps(dict(zip(layout.others, values, strict=True)), default=str).encode()
                )
        self.rows += rows
        if self.progress is not None:
            self.progress(self.rows)

    def scanned(self, files: tuple[str, ...], root: Path, url: str, versions: Mapping[str, Any]) -> Scanned:
        if not self.rows or self.layout is None:
            raise DatasetError(f"the Parquet files at {url or root} hold no rows")
        g = self.groups
        metadata = ListMetadata("jsonl", (), self.metadata.build()) if self.layout.others else None
        part = ParquetRows(
            files=files,
            codecs=tuple(g.codecs),
            max_def=self.layout.max_def,
            sample_group=np.concatenate(self.sample_group),
            sample_row=np.concatenate(self.sample_row),
            group_file=np.asarray(g.file, np.int32),
            group_start=np.asarray(g.start, np.int64),
            group_size=np.asarray(g.size, np.int64),
            group_rows=np.asarray(g.rows, np.int64),
            group_codec=np.asarray(g.codec, np.uint8),
            metadata=metadata,
        )
        labels = np.concatenate(self.labels)
        return Scanned(root, self.layout.classes, labels, self.names.build(), part, {}, url, dict(versions))


def _chunk(column: Any, rows: int, max_def: int) -> Chunk:
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    return Chunk(int(start), int(column.total_compressed_size), str(column.compression), rows, max_def, 0)


def _labels(column: Any, rows: int) -> I64:
    if column is None:
        return np.full(rows, NO_LABEL, np.int64)
    import pyarrow as pa

    if not pa.types.is_integer(column.type):
        raise DatasetError(f"the label column is {column.type}, not integers: say which with --label-column")
    values = np.asarray(column.to_numpy(zero_copy_only=False))  # float where there are nulls
    labels = np.full(rows, NO_LABEL, np.int64)
    present = ~np.asarray(column.is_null().to_numpy(zero_copy_only=False))
    kept = values[present]
    if kept.size and (kept.max() > np.iinfo(np.int64).max or kept.min() < np.iinfo(np.int64).min):
        raise DatasetError(f"the label column holds {kept.max()}: labels must fit in 64 bits")
    labels[present] = kept.astype(np.int64)
    return labels
