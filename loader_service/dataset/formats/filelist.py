"""The list source: a ``.csv`` or ``.jsonl`` file naming one image per row, in row order.

csv: a header row; column ``path`` required, ``label`` optional (an integer; an empty cell is no label,
-1); every other column is metadata, kept as a string. jsonl: one object a line, ``path`` a string,
``label`` an integer or null or absent, every other key metadata with its JSON value. Paths are
relative to the list file's folder, or absolute. Blank lines are not samples. A row without a path or
with a label that is not an integer stops the build with an error naming the line: a list that is
wrong in one place is likely wrong in many, and skipping rows would shift every index after them.

Files are not looked at here (a million stats cost seconds); a missing file is a bad sample when read.
"""

from __future__ import annotations

import contextlib
import csv
import json
from array import array
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from loader_service.dataset.format import (
    Columns,
    Format,
    Indexed,
    IndexPart,
    Mapped,
    Metadata,
    Progress,
    Scanned,
)
from loader_service.dataset.formats.perfile import FilePerSample, SampleFiles
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_file
from loader_service.dataset.storage.local import Files
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import (
    I64,
    DatasetError,
    ListMetadata,
    StringTable,
    StringTableBuilder,
    encode_name,
    packed,
)
from protocol.pixels import DecodeError

LIST_SUFFIXES = {".csv": "csv", ".jsonl": "jsonl"}
MAX_LIST_BYTES = 16 << 30
"""A list file is read whole at start (a store's fetched first): one larger than this is a mistake."""
NO_LABEL = -1
_INT64 = (-(2**63), 2**63 - 1)


class ListScan(NamedTuple):
    labels: I64
    paths: StringTable
    metadata: ListMetadata | None


class _Rows:
    """What a scan accumulates, row by row."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.labels = array("q")
        self.paths = StringTableBuilder()
        self.metadata = StringTableBuilder()
        self.has_metadata = False
        self.progress = progress

    def add(self, path: bytes, label: int, metadata: bytes) -> None:
        self.paths.add(path)
        self.labels.append(label)
        self.metadata.add(metadata)
        self.has_metadata = self.has_metadata or bool(metadata)
        if self.progress is not None and len(self.labels) % 10_000 == 0:
            self.progress(len(self.labels))

    def build(self, where: str, style: str, columns: tuple[str, ...]) -> ListScan:
        if not self.labels:
            raise DatasetError(f"{where} lists no samples")
        metadata = ListMetadata(style, columns, self.metadata.build()) if self.has_metadata else None
        return ListScan(packed(self.labels, np.int64), self.paths.build(), metadata)


def list_style(path: Path) -> str:
    """``csv`` or ``jsonl``, from the suffix, else from the first character (``{`` is jsonl)."""
    style = LIST_SUFFIXES.get(path.suffix.lower())
    if style is not None:
        return style
    with open(path, "rb") as f:
        return "jsonl" if f.read(4096).lstrip().startswith(b"{") else "csv"


def scan_list(path: Path, progress: Callable[[int], None] | None = None, shown: str = "") -> ListScan:
    """The list file ``path``, named ``shown`` in messages (default: its path)."""
    shown = shown or str(path)
    if not path.is_file():
        raise DatasetError(f"list file {path} does not exist or is not a file")
    if list_style(path) == "jsonl":
        return _scan_jsonl(path, progress, shown)
    return _scan_csv(path, progress, shown)


def _scan_csv(path: Path, progress: Callable[[int], None] | None, shown: str) -> ListScan:
    rows = _Rows(progress)
    # utf-8-sig drops the byte-order mark spreadsheets write; surrogateescape keeps any file name.
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise DatasetError(f"{shown} is empty: expected a header row naming a 'path' column")
        path_col, label_col, meta_cols = _header(shown, header)
        width = len(header)
        try:
            for row in reader:
                if not row:
                    continue
                line = f"{shown}:{reader.line_num}"
                if len(row) != width:
                    raise DatasetError(f"{line}: {len(row)} cells, the header has {width}")
                label = NO_LABEL if label_col is None else _csv_label(line, row[label_col])
                cells = [row[c] for c in meta_cols]
                rows.add(_path(line, row[path_col]), label, json.dumps(cells).encode() if cells else b"")
        except csv.Error as exc:
            raise DatasetError(f"{shown}:{reader.line_num}: {exc}") from None
    return rows.build(shown, "csv", tuple(header[c] for c in meta_cols))


def _header(shown: str, header: list[str]) -> tuple[int, int | None, list[int]]:
    names = [name.strip() for name in header]
    for k, name in enumerate(names):
        if not name:
            raise DatasetError(f"{shown}:1: column {k + 1} of the header has no name")
        if names.index(name) != k:
            raise DatasetError(f"{shown}:1: column {name!r} appears twice in the header")
    if "path" not in names:
        raise DatasetError(f"{shown}:1: the header has no 'path' column (columns: {', '.join(names)})")
    header[:] = names
    label = names.index("label") if "label" in names else None
    return names.index("path"), label, [k for k, n in enumerate(names) if n not in ("path", "label")]


def _path(line: str, text: str) -> bytes:
    if not text.strip():
        raise DatasetError(f"{line}: the path is empty")
    try:
        return encode_name(text)
    except UnicodeEncodeError:  # a JSON escape of half a character
        raise DatasetError(f"{line}: the path is not utf-8: {text!r:.60}") from None


def _csv_label(line: str, cell: str) -> int:
    cell = cell.strip()
    if not cell:
        return NO_LABEL
    try:
        if "_" in cell:  # int() reads "1_000"; a list should not
            raise ValueError
        label = int(cell)
    except ValueError:
        raise DatasetError(f"{line}: label {cell[:40]!r} is not an integer") from None
    return _in_range(line, label)


def _in_range(line: str, label: int) -> int:
    if not _INT64[0] <= label <= _INT64[1]:
        raise DatasetError(f"{line}: label {label} does not fit in 64 bits")
    return label


def _scan_jsonl(path: Path, progress: Callable[[int], None] | None, shown: str) -> ListScan:
    rows = _Rows(progress)
    with open(path, "rb") as f:
        for number, text in _numbered_lines(f):
            line = f"{shown}:{number}"
            obj = _json_object(line, text)
            raw_path = obj.pop("path", None)
            if not isinstance(raw_path, str):
                raise DatasetError(f"{line}: 'path' must be a string, got {_kind(raw_path)}")
            label = _json_label(line, obj.pop("label", None))
            metadata = json.dumps(obj).encode() if obj else b""
            rows.add(_path(line, raw_path), label, metadata)
    return rows.build(shown, "jsonl", ())


def _numbered_lines(f: Any) -> Iterator[tuple[int, bytes]]:
    for number, text in enumerate(f, start=1):
        if text.strip():
            yield number, text


def _json_object(line: str, text: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise DatasetError(f"{line}: not valid JSON: {exc}") from None
    except RecursionError:  # a line of ten thousand nested brackets
        raise DatasetError(f"{line}: JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{line}: expected a JSON object, got {_kind(obj)}")
    return obj


def _json_label(line: str, value: object) -> int:
    if value is None:
        return NO_LABEL
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(f"{line}: label must be an integer or null, got {_kind(value)} {value!r:.40}")
    return _in_range(line, value)


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


class ListFormat(FilePerSample):
    """``--format list`` (``dataset.format.Format``)."""

    name = "list"
    what = "a .csv or .jsonl list"
    holds = ".csv or .jsonl files (a list?)"
    in_store = "files"

    def claims_folder(self, root: Path) -> bool:
        return False

    def claims_file(self, name: str) -> bool:
        return name.endswith(tuple(LIST_SUFFIXES))

    def claims_pattern(self, text: str) -> bool:
        return False

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        """The list, local or in a store (fetched whole first: its rows name the files relative to
        its folder, or by full URL)."""
        listing = list_file(data, _the_file)
        name = listing.names[0]
        size = listing.size(name)
        if size is not None and size > MAX_LIST_BYTES:
            raise DatasetError(
                f"{listing.where(name)} has {size} bytes: a list over {MAX_LIST_BYTES} is a mistake"
            )
        with contextlib.closing(listing.local_copies()) as copies:  # a store's copy goes after
            _, path = next(copies)
            found = scan_list(path, progress, shown=listing.where(name))
        return Scanned(listing.root, (), found.labels, found.paths, found.metadata, url=listing.url)

    def inputs(self, data: Location) -> Any:
        """The list file's size and ETag (object store) or mtime; the listed files are not looked at,
        as the scan does not look at them."""
        return list_file(data, _the_file).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        facts = described.get("metadata")
        if facts is None:
            return None
        values = StringTable(mapped("metadata_offsets"), mapped("metadata_blob"))
        return ListMetadata(facts["style"], tuple(facts["columns"]), values)

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> ListReader:
        metadata = index.part if isinstance(index.part, ListMetadata) else None
        return ListReader(open_files(index, storage, max_bytes, heard), index.names, max_bytes, metadata)


def _the_file(path: Path) -> tuple[Path, tuple[str, ...]]:
    if not path.is_file():
        raise DatasetError(f"list file {path} does not exist or is not a file")
    return path.parent, (path.name,)


class ListReader(SampleFiles):
    """The listed files, and each row's other columns (csv: strings) or keys (jsonl: JSON values)."""

    def __init__(self, files: Files, names: StringTable, max_bytes: int, listed: ListMetadata | None) -> None:
        super().__init__(files, names, max_bytes)
        self.listed = listed

    def metadata(self, i: int) -> Metadata:
        return listed_metadata(self.listed, i)


def listed_metadata(listed: ListMetadata | None, i: int) -> Metadata:
    """Sample ``i``'s items of ``listed`` (a list's other columns, a Parquet file's), each a call."""
    if listed is None:
        return {}
    try:
        items = listed.items(i)
    except (ValueError, TypeError) as exc:  # the index was written by us: only damage gets here
        raise DecodeError(f"metadata: {exc}") from None
    return {name: partial(_value, value) for name, value in items.items()}


def _value(value: object) -> object:
    return value


FORMAT: Format = ListFormat()
