"""Indexing a ``save_to_disk`` folder: ``state.json``'s files in order, each walked batch by batch
for where its image bytes lie, without copying a byte of them.

NOTE [ Arrow offsets ]
    ``datasets`` writes Arrow IPC *stream* files (no footer to seek to), 100 image rows a record
    batch. Each file is memory-mapped and its batches read by pyarrow; a batch's buffers are then
    views of the map, so the image column's data buffer's address less the map's says where the
    buffer lies in the file, and its offsets buffer where each row's bytes lie in it. That file
    offset and length is all a worker needs: one ranged read a sample, as for Parquet's pages and
    tar's members. A buffer that is no view of the map (a compressed IPC file: LZ4 or ZSTD bodies)
    has no place in the file to read from, so such a file is refused by name. In an object store a
    file is fetched whole to be walked (its batches' headers are spread through it; the cache
    folder keeps it if there is one), then read by range.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from loader_service.dataset.format import Columns, Progress
from loader_service.dataset.formats.features import hf_features, is_binary, is_image
from loader_service.dataset.tables import DatasetError, StringTableBuilder, encode_name

STATE = "state.json"
SPLITS = "dataset_dict.json"
NO_LABEL = -1
PROGRESS_EVERY = 10_000


def _pa() -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise DatasetError("reading Arrow files needs pyarrow: pip install 'dataferry[parquet]'") from None
    return pa


def data_files(root: Path) -> tuple[str, ...]:
    """The Arrow files of a ``save_to_disk`` folder, in ``state.json``'s order; a ``DatasetDict``
    folder is refused naming its splits."""
    if (root / SPLITS).is_file() and not (root / STATE).is_file():
        splits = _json((root / SPLITS).read_text(), str(root / SPLITS)).get("splits") or sorted(
            p.name for p in root.iterdir() if p.is_dir()
        )
        raise DatasetError(
            f"{root} is a datasets DatasetDict of splits {', '.join(map(str, splits))}: "
            f"give one split's folder as --data ({root / str(splits[0])})"
        )
    try:
        text = (root / STATE).read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {root / STATE}: {exc.strerror or exc}") from None
    return listed_files(text, str(root / STATE))


def listed_files(state: bytes, where: str) -> tuple[str, ...]:
    """The data files a ``state.json``'s text lists (``where`` names it in errors)."""
    value = _json(state, where)
    listed = value.get("_data_files")
    if not isinstance(listed, list) or not listed:
        raise DatasetError(f"{where} lists no data files (_data_files)")
    names = []
    for entry in listed:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise DatasetError(f"{where} lists a data file that is no file name: {entry!r}")
        names.append(name)
    return tuple(names)


def _json(text: bytes | str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DatasetError(f"cannot read {where}: {exc}") from None
    if not isinstance(value, dict):
        raise DatasetError(f"{where} is not a JSON object")
    return value


class ArrowScan:
    """Rows, labels and where each image lies, file by file."""

    def __init__(self, columns: Columns, progress: Progress | None) -> None:
        self.columns = columns
        self.progress = progress
        self.sample_file = array("i")
        self.offset = array("q")
        self.size = array("q")
        self.labels = array("q")
        self.names = StringTableBuilder()
        self.flaws: dict[int, str] = {}
        self.classes: tuple[str, ...] | None = None

    def add(self, k: int, name: str, path: Path, where: str) -> None:
        """File ``k`` of the folder, ``name``, as the local file ``path`` (``where`` in errors)."""
        pa = _pa()
        mapped = pa.memory_map(str(path))
        try:
            size = mapped.size()
            base = mapped.read_buffer(size).address
            mapped.seek(0)
            try:
                reader = pa.ipc.open_stream(mapped)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DatasetError(f"{where} is not an Arrow stream file: {exc}") from None
            image, label, classes = self._layout(reader.schema, where)
            if self.classes is None:
                self.classes = classes
            row = 0
            try:
                for batch in reader:
                    self._batch(k, name, batch, image, label, (base, size), row, where)
                    row += batch.num_rows
            except (pa.ArrowInvalid, OSError) as exc:  # a body cut short is an OSError
                raise DatasetError(f"{where}: a record batch after row {row} is damaged: {exc}") from None
        finally:
            mapped.close()

    def _layout(self, schema: Any, where: str) -> tuple[str, str | None, tuple[str, ...]]:
        """The image column, the label column (None: every label -1) and the ClassLabel's names."""
        pa = _pa()
        features = hf_features(schema.metadata or {}, where)
        image = self.columns.image or next((k for k, v in features.items() if is_image(v)), "image")
        if image not in schema.names:
            raise DatasetError(f"{where} has no image column {image!r} (columns: {', '.join(schema.names)}); "
                               "say which with --image-column")  # fmt: skip
        kind = schema.field(image).type
        struct = pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
        if not is_binary(kind) and not (struct and is_binary(kind.field("bytes").type)):
            raise DatasetError(
                f"{where}: column {image!r} is {kind}, not binary nor a struct of bytes and path"
            )
        label = self.columns.label if self.columns.label in schema.names else None
        feature = features.get(label or "", {})
        classes = tuple(feature.get("names") or ()) if isinstance(feature, dict) else ()
        return image, label, classes

    def _batch(
        self, k: int, name: str, batch: Any, image: str, label: str | None,
        mapped: tuple[int, int], first: int, where: str,
    ) -> None:  # fmt: skip
        pa = _pa()
        column = batch.column(image)
        data = column.field("bytes") if pa.types.is_struct(column.type) else column
        paths = column.field("path") if pa.types.is_struct(column.type) else None
        _, offsets_buffer, data_buffer = data.buffers()
        base, size = mapped
        width = np.int64 if pa.types.is_large_binary(data.type) else np.int32
        offsets = np.frombuffer(offsets_buffer, dtype=width)[data.offset : data.offset + len(data) + 1]
        if data_buffer is not None and not base <= data_buffer.address <= base + size:
            raise DatasetError(f"{where}: its buffers are compressed (LZ4 or ZSTD): save it again without "
                               "compression to read it by range")  # fmt: skip
        start = 0 if data_buffer is None else data_buffer.address - base
        valid = data.is_valid().to_numpy(zero_copy_only=False)
        if paths is not None:  # a null struct is no image, whatever its child holds
            valid &= column.is_valid().to_numpy(zero_copy_only=False)
        labels = self._labels(batch, label, len(data))
        for r in range(len(data)):
            i = len(self.labels)
            self.sample_file.append(k)
            self.offset.append(start + int(offsets[r]))
            self.size.append(int(offsets[r + 1] - offsets[r]))
            self.labels.append(int(labels[r]))
            self.names.add(encode_name(f"{name}:{first + r}"))
            if not valid[r]:
                has_path = paths is not None and column[r].is_valid and bool(paths[r].as_py())
                self.flaws[i] = (
                    "its image is only a path (datasets' Image feature without bytes): not read"
                    if has_path
                    else "its image is null"
                )
            if self.progress is not None and (i + 1) % PROGRESS_EVERY == 0:
                self.progress(i + 1)

    @staticmethod
    def _labels(batch: Any, label: str | None, rows: int) -> Any:
        if label is None:
            return np.full(rows, NO_LABEL, dtype=np.int64)
        values = batch.column(label)
        try:
            return values.fill_null(NO_LABEL).to_numpy(zero_copy_only=False).astype(np.int64)
        except (TypeError, ValueError, _pa().ArrowInvalid):
            raise DatasetError(f"label column {label!r} holds {values.type}, not integers") from None
