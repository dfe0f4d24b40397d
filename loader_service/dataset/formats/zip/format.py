"""The zip format (``dataset.format.Format``): one ``.zip`` archive of class folders, on the local disk
or in an object store, indexed from its central directory (NOTE [ Zip directory ]) and ordered as the
ImageFolder it would be if extracted (NOTE [ Zip as an ImageFolder ]); members read by range (NOTE
[ Zip member reads ]). Stored and deflated members, ZIP64 included."""

from __future__ import annotations

import contextlib
import io
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from loader_service.dataset.format import Columns, Format, Indexed, IndexPart, Mapped, Progress, Scanned
from loader_service.dataset.formats.zip.central import read_entries
from loader_service.dataset.formats.zip.members import ZipMembers
from loader_service.dataset.formats.zip.reader import ZipReader
from loader_service.dataset.formats.zip.tree import as_image_folder
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_file
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DatasetError, StringTableBuilder, encode_name, packed

SUFFIX = ".zip"


class ZipFormat:
    """``--format zip`` (``dataset.format.Format``)."""

    name = "zip"
    what = "a .zip archive of class folders"
    holds = "a .zip archive"
    in_store = "files"

    def claims_folder(self, root: Path) -> bool:
        return False

    def claims_file(self, name: str) -> bool:
        return name.endswith(SUFFIX)

    def claims_pattern(self, text: str) -> bool:
        return False

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        listing = list_file(data, _the_archive)
        (archive,) = listing.names
        where = listing.where(archive)
        with contextlib.closing(listing.ranges()) as ranges:
            for _, source in ranges:
                with _opened(source) as fh:
                    size = fh.seek(0, io.SEEK_END)
                    entries = read_entries(fh, size, where, progress)
        tree = as_image_folder(entries, where)
        names = StringTableBuilder()
        for k in tree.order:
            names.add(encode_name(entries.names[k]))
        order = np.asarray(tree.order, dtype=np.int64)

        def column(values: array[int], dtype: type[np.generic]) -> Any:
            picked = np.asarray(values, dtype=np.int64)[order] if len(order) else np.zeros(0, np.int64)
            out = np.clip(picked, 0, np.iinfo(dtype).max).astype(dtype)  # type: ignore[type-var]
            out.flags.writeable = False
            return out

        part = ZipMembers(
            archive=archive,
            offset=column(entries.offsets, np.int64),
            compressed=column(entries.compressed, np.int64),
            size=column(entries.sizes, np.int64),
            crc=column(entries.crcs, np.uint32),
            method=column(entries.methods, np.uint8),
            header=column(entries.headers, np.uint32),
        )
        labels = packed(array("q", tree.labels), np.int64)
        return Scanned(listing.root, tree.classes, labels, names.build(), part, tree.flaws,
                       listing.url, listing.versions())  # fmt: skip

    def inputs(self, data: Location) -> Any:
        """The archive's size and mtime (local disk) or ETag (object store)."""
        return list_file(data, _the_archive).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        return ZipMembers(
            archive=str(described["zip"]["archive"]),
            offset=mapped("zip_offset"),
            compressed=mapped("zip_compressed"),
            size=mapped("zip_size"),
            crc=mapped("zip_crc"),
            method=mapped("zip_method"),
            header=mapped("zip_header"),
        )

    def relpath(self, index: Indexed, i: int) -> str:
        return f"{_members(index).archive}:{index.names.text(i)}"

    def path(self, index: Indexed, i: int) -> Path:
        return index.root / _members(index).archive

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> ZipReader:
        return ZipReader(
            open_files(index, storage, max_bytes, heard), index.names, _members(index), max_bytes
        )


def _the_archive(path: Path) -> tuple[Path, tuple[str, ...]]:
    if not path.is_file():
        raise DatasetError(f"zip archive {path} does not exist or is not a file")
    return path.parent, (path.name,)


def _opened(source: Any) -> contextlib.AbstractContextManager[BinaryIO]:
    """A path as a file opened for reading; an object, read by range, as it is: each read one GET."""
    if isinstance(source, str):
        return open(source, "rb")
    return contextlib.nullcontext(source)


def _members(index: Indexed) -> ZipMembers:
    assert isinstance(index.part, ZipMembers), "a zip index holds its members"
    return index.part


FORMAT: Format = ZipFormat()
