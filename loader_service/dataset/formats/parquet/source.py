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
the data page holding its row (``parquetpages``: the page headers of a chunk are read once, then each
image costs its page, plus the dictionary page while pyarrow's dictionary encoding lasts). In an
object store the files are fetched once into the cache folder at start when there is one (as
``datasets`` itself caches files), else read by range.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.formats.filelist import listed_metadata
from loader_service.dataset.formats.parquet.pagemodel import Chunk, ParquetPageError
from loader_service.dataset.formats.parquet.pages import ChunkPages
from loader_service.dataset.source import (
    Columns,
    Indexed,
    IndexPart,
    Mapped,
    Metadata,
    Progress,
    Scanned,
    Source,
)
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_files
from loader_service.dataset.storage.local import Files
from loader_service.dataset.storage.objectstore import StorageConfig
from loader_service.dataset.storage.patterns import expand_braces, is_brace_pattern
from loader_service.dataset.tables import (
    I64,
    DatasetError,
    DecodeError,
    ListMetadata,
    StringTable,
    StringTableBuilder,
)

log = logging.getLogger(__name__)

SUFFIX = ".parquet"
NO_LABEL = -1
MAX_ROWS_PER_FILE = 1 << 31
"""Rows of one file: a row's place in its group is an int32."""
OPEN_CHUNKS = 256
"""Page maps a reader keeps (one per row group it read from): a few KiB each."""
HF_KEY = b"huggingface"


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("reading Parquet needs pyarrow: pip install 'dataferry[parquet]'") from None
    return pq


# --- the index's part -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ParquetRows:
    """Where each row's image lies: its row group (an id over all files) and its row in that group;
    per group, its file and the image column's chunk (``parquetpages.Chunk``)."""

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


class _Groups:
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


# --- the scan ---------------------------------------------------------------------------------------


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
    features = _hf_features(schema.metadata or {}, where)
    image = columns.image or next((k for k, v in features.items() if _is_image(v)), "image")
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
    skipped = {n for n in schema.names if _holds_binary(schema.field(n).type) or _is_image(features.get(n))}
    others = tuple(n for n in schema.names if n not in (image, label) and n not in skipped)
    return _Layout(leaf, md.column(leaf).max_definition_level, label, classes, others)


def _hf_features(metadata: Mapping[bytes, bytes], where: str) -> dict[str, Any]:
    """The features ``datasets`` wrote in the file's metadata; {} if it wrote none we can read."""
    try:
        info = json.loads(metadata.get(HF_KEY, b"{}"))
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    except RecursionError:  # the file's writer decides how deep its JSON goes
        raise DatasetError(
            f"{where}: its {HF_KEY.decode()} metadata is nested too deeply to read; "
            "rewrite the file without it"
        ) from None
    return features if isinstance(features, dict) else {}


def _is_image(feature: Any) -> bool:
    return isinstance(feature, dict) and feature.get("_type") == "Image"


def _image_leaf(field: Any, name: str, where: str) -> str:
    import pyarrow as pa

    if _is_binary(field.type):
        return name
    struct = pa.types.is_struct(field.type) and field.type.get_field_index("bytes") >= 0
    if struct and _is_binary(field.type.field("bytes").type):
        return f"{name}.bytes"
    raise DatasetError(f"{where}: column {name!r} is {field.type}, not binary nor a struct of bytes and path")


def _holds_binary(kind: Any) -> bool:
    """Is ``kind`` binary, or a struct or list with binary inside?"""
    import pyarrow as pa

    if _is_binary(kind):
        return True
    if pa.types.is_struct(kind):
        return any(_holds_binary(kind.field(k).type) for k in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _holds_binary(kind.value_type)
    return False


def _is_binary(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


class _Scan:
    """Rows, labels, names and metadata of each file in turn."""

    def __init__(self, columns: Columns, progress: Progress | None) -> None:
        self.columns = columns
        self.progress = progress
        self.groups = _Groups()
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


# --- listing --------------------------------------------------------------------------------------


def local_files(data: str | Path) -> tuple[Path, tuple[str, ...]]:
    """The root folder and the files relative to it, in row order; each must exist."""
    root, names = _local_names(str(data))
    for name in names:
        if not (root / name).is_file():
            raise DatasetError(f"Parquet file {root / name} does not exist")
    return root, names


def _local_names(text: str) -> tuple[Path, tuple[str, ...]]:
    if os.path.isdir(text):
        with os.scandir(text) as it:
            names = sorted(e.name for e in it if e.name.endswith(SUFFIX) and e.is_file())
        if not names:
            raise DatasetError(f"no {SUFFIX} files in {text}")
        return Path(text), tuple(names)
    if os.path.exists(text) or not is_brace_pattern(text):
        return Path(text).parent, (Path(text).name,)
    paths = expand_braces(text)
    root = os.path.commonpath([os.path.dirname(p) or "." for p in paths])
    return Path(root), tuple(os.path.relpath(p, root) for p in paths)


# --- the source -----------------------------------------------------------------------------------


class ParquetSource:
    """``--format parquet`` (``dataset.source.Source``)."""

    name = "parquet"
    what = "a .parquet file, a folder of them or a brace pattern"
    holds = ".parquet files"
    remote = "folder"

    def claims_folder(self, root: Path) -> bool:
        with os.scandir(root) as it:
            return any(e.name.endswith(SUFFIX) for e in it)

    def claims_file(self, name: str) -> bool:
        return name.endswith(SUFFIX)

    def claims_pattern(self, text: str) -> bool:
        return is_brace_pattern(text) and text.endswith(SUFFIX)

    def scan(
        self, data: str | Path, progress: Progress | None, storage: StorageConfig, columns: Columns
    ) -> Scanned:
        listing = list_files(data, storage, SUFFIX, "Parquet files", local_files)
        found = _Scan(columns, progress)
        with contextlib.closing(listing.sources()) as sources:  # a failed scan's fetched files go now
            for k, (name, source) in enumerate(sources):
                found.add(k, name, source, listing.where(name))
        return found.scanned(listing.names, listing.root, listing.url, listing.versions())

    def inputs(self, data: str | Path, storage: StorageConfig) -> Any:
        return list_files(data, storage, SUFFIX, "Parquet files", local_files).stamps()

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

    def reader(self, index: Indexed, max_bytes: int, storage: StorageConfig) -> ParquetReader:
        return ParquetReader(open_files(index, storage, max_bytes), _rows(index), max_bytes, exact=True)


def _rows(index: Indexed) -> ParquetRows:
    assert isinstance(index.part, ParquetRows), "a parquet index holds its rows"
    return index.part


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


SOURCE: Source = ParquetSource()
