"""The tfrecord format (``dataset.format.Format``): TFRecord files of ``tf.train.Example`` records,
read without TensorFlow. ``--data`` is a file, a folder of them (sorted by name) or a brace pattern,
named ``*.tfrecord*`` or as TensorFlow's scripts name them (``train-00000-of-01024``), local or in a
store. Sample ``i`` is record ``i`` across the files in order; its image is the bytes feature
``image/encoded`` (``--image-column``), its label the int64 feature ``image/class/label``
(``--label-column``) less ``--label-offset``. Framing and checksums: NOTE [ TFRecord framing ];
features: NOTE [ Example features ]."""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loader_service.dataset.format import Columns, Format, Indexed, IndexPart, Mapped, Progress, Scanned
from loader_service.dataset.formats.tfrecord.crc import masked
from loader_service.dataset.formats.tfrecord.example import Feature, features
from loader_service.dataset.formats.tfrecord.framing import (
    FOOTER,
    HEADER,
    Damage,
    compression,
    named_as_tfrecord,
    records,
)
from loader_service.dataset.formats.tfrecord.reader import TFRecordReader
from loader_service.dataset.formats.tfrecord.records import TFRecords
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_files, local_named
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.patterns import expand_braces, is_brace_pattern
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DatasetError, StringTableBuilder, encode_name, packed

log = logging.getLogger(__name__)
IMAGE = "image/encoded"
LABEL = "image/class/label"
NO_LABEL = -1
PROGRESS_EVERY = 10_000


class TFRecordFormat:
    """``--format tfrecord`` (``dataset.format.Format``)."""

    name = "tfrecord"
    what = "TFRecord files of tf.train.Example (*.tfrecord*, train-00000-of-01024), a folder or a pattern"
    holds = "TFRecord files"
    in_store = "folder"

    def claims_folder(self, root: Path) -> bool:
        with os.scandir(root) as it:
            return any(e.is_file() and named_as_tfrecord(e.name) for e in it)

    def claims_file(self, name: str) -> bool:
        return named_as_tfrecord(name)

    def claims_pattern(self, text: str) -> bool:
        return is_brace_pattern(text) and named_as_tfrecord(expand_braces(text)[0])

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        listing = list_files(data, named_as_tfrecord, "TFRecord files", _local_files)
        found = _Scan(columns, progress)
        with contextlib.closing(listing.local_copies()) as copies:  # a failed scan's files go now
            for k, (name, path) in enumerate(copies):
                found.add(k, name, path, listing.where(name))
        if not found.labels:
            raise DatasetError(
                f"no records in {listing.folder}: {', '.join(found.damaged) or 'every file is empty'}"
            )
        part = TFRecords(
            files=listing.names,
            sample_file=packed(found.sample_file, np.int32),
            offset=packed(found.offset, np.int64),
            length=packed(found.length, np.int64),
            image_offset=packed(found.image_offset, np.int64),
            image_length=packed(found.image_length, np.int64),
        )
        return Scanned(listing.root, (), packed(found.labels, np.int64), found.names.build(), part,
                       found.flaws, listing.url, listing.versions())  # fmt: skip

    def inputs(self, data: Location) -> Any:
        """Each file's name, size and ETag (object store) or mtime (local disk)."""
        return list_files(data, named_as_tfrecord, "TFRecord files", _local_files).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        return TFRecords(
            files=tuple(described["tfrecord"]["files"]),
            sample_file=mapped("tfr_file"),
            offset=mapped("tfr_offset"),
            length=mapped("tfr_length"),
            image_offset=mapped("tfr_image_offset"),
            image_length=mapped("tfr_image_length"),
        )

    def relpath(self, index: Indexed, i: int) -> str:
        return index.names.text(i)

    def path(self, index: Indexed, i: int) -> Path:
        part = _records(index)
        return index.root / part.files[int(part.sample_file[i])]

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> TFRecordReader:
        return TFRecordReader(
            open_files(index, storage, max_bytes, heard), index.names, _records(index), max_bytes
        )


def _local_files(data: Path) -> tuple[Path, tuple[str, ...]]:
    """The root folder and the files relative to it, in record order; each must exist."""
    return local_named(data, named_as_tfrecord, "TFRecord files (*.tfrecord*, train-00000-of-01024)")


class _Scan:
    """Records, labels and where each image lies, file by file (NOTE [ TFRecord framing ])."""

    def __init__(self, columns: Columns, progress: Progress | None) -> None:
        self.image = columns.image or IMAGE
        self.label = columns.label
        self.offset_by = columns.label_offset
        self.progress = progress
        self.sample_file, self.offset, self.length = array("i"), array("q"), array("q")
        self.image_offset, self.image_length, self.labels = array("q"), array("q"), array("q")
        self.names = StringTableBuilder()
        self.flaws: dict[int, str] = {}
        self.damaged: list[str] = []

    def add(self, k: int, name: str, path: Path, where: str) -> None:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(0)
            if kind := compression(fh.read(HEADER)):
                raise DatasetError(
                    f"{where} is {kind}-compressed: decompress it first (TFRecords are read by range)"
                )
            damage: list[Damage] = []
            for record in records(fh, size, damage):
                fh.seek(record.offset)
                data = fh.read(record.length + FOOTER)
                self._record(k, name, record.number, record.offset, data)
            for d in damage:
                self.damaged.append(f"{where}: {d.why}")
                log.warning("TFRecord file %s: %s; the records after it are skipped", where, d.why)

    def _record(self, k: int, name: str, number: int, offset: int, data: bytes) -> None:
        i = len(self.labels)
        body = memoryview(data)[: len(data) - FOOTER]
        self.sample_file.append(k)
        self.offset.append(offset)
        self.length.append(len(body))
        self.names.add(encode_name(f"{name}:{number}"))
        image, label, why = (0, 0), NO_LABEL, ""
        if masked(body) != struct.unpack_from("<I", data, len(body))[0]:
            why = "its data fails its CRC-32C (the file is damaged)"
        else:
            try:
                found = features(body)
            except ValueError as exc:
                found, why = {}, f"it is no tf.train.Example: {exc}"
            if not why:
                image, label, why = self._image_and_label(found)
        self.image_offset.append(image[0])
        self.image_length.append(image[1])
        self.labels.append(label)
        if why:
            self.flaws[i] = why
        if self.progress is not None and (i + 1) % PROGRESS_EVERY == 0:
            self.progress(i + 1)

    def _image_and_label(self, found: dict[str, Feature]) -> tuple[tuple[int, int], int, str]:
        image = found.get(self.image)
        if image is None or image.kind != "bytes" or not image.values:
            named = ", ".join(sorted(found)) or "none"
            return (
                (0, 0),
                NO_LABEL,
                f"it has no bytes feature {self.image!r} (features: {named}); see --image-column",
            )
        # ``--label-column`` left at its default names TensorFlow's ImageNet feature unless the
        # Example has one called ``label``.
        label_name = self.label if self.label in found or self.label != "label" else LABEL
        label = found.get(label_name)
        value = NO_LABEL
        if label is not None and label.kind == "int64" and label.values:
            number = label.values[0]
            value = int(number) - self.offset_by if isinstance(number, int) else NO_LABEL
            value = value if value >= 0 else NO_LABEL
        where = image.values[0]
        assert isinstance(where, tuple), "a bytes feature's values are (offset, length)"
        return (int(where[0]), int(where[1])), value, ""


def _records(index: Indexed) -> TFRecords:
    assert isinstance(index.part, TFRecords), "a tfrecord index holds its records"
    return index.part


FORMAT: Format = TFRecordFormat()
