"""The arrow format (``dataset.format.Format``): a folder Hugging Face ``datasets`` wrote with
``save_to_disk`` (``state.json`` and its ``data-*.arrow`` files), local or in an object store.
Sample ``i`` is row ``i`` across the files in ``state.json``'s order; the image column and the
label are found as for Parquet (``--image-column``, ``--label-column``, the ``Image`` and
``ClassLabel`` features); each image is read by range where the scan found it (NOTE [ Arrow
offsets ]). Needs pyarrow (``dataferry[parquet]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loader_service.dataset.format import Columns, Format, Indexed, IndexPart, Mapped, Progress, Scanned
from loader_service.dataset.formats.arrow.reader import ArrowReader
from loader_service.dataset.formats.arrow.rows import ArrowRows
from loader_service.dataset.formats.arrow.scan import SPLITS, STATE, ArrowScan, data_files, listed_files
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import Listing, LocalListing
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectfolder import RangedFile, StoreObjects, store_object
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DatasetError, packed

SUFFIX = ".arrow"


class ArrowFormat:
    """``--format arrow`` (``dataset.format.Format``)."""

    name = "arrow"
    what = "a folder datasets' save_to_disk wrote (state.json and data-*.arrow)"
    holds = "a datasets save_to_disk folder (state.json)"
    in_store = "folder"

    def claims_folder(self, root: Path) -> bool:
        return (root / STATE).is_file() or (root / SPLITS).is_file()

    def claims_file(self, name: str) -> bool:
        return name == STATE or name.endswith("/" + STATE)

    def claims_pattern(self, text: str) -> bool:
        return False

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        listing = _listing(data)
        found = ArrowScan(columns, progress)
        with contextlib.closing(listing.local_copies()) as copies:  # a failed scan's files go now
            for k, (name, path) in enumerate(copies):
                found.add(k, name, path, listing.where(name))
        rows = ArrowRows(
            files=listing.names,
            sample_file=packed(found.sample_file, np.int32),
            offset=packed(found.offset, np.int64),
            size=packed(found.size, np.int64),
        )
        labels = packed(found.labels, np.int64)
        return Scanned(listing.root, found.classes or (), labels, found.names.build(), rows, found.flaws,
                       listing.url, listing.versions())  # fmt: skip

    def inputs(self, data: Location) -> Any:
        """Each file's name, size and ETag (object store) or mtime (local disk)."""
        return _listing(data).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        return ArrowRows(
            files=tuple(described["arrow"]["files"]),
            sample_file=mapped("arrow_file"),
            offset=mapped("arrow_offset"),
            size=mapped("arrow_size"),
        )

    def relpath(self, index: Indexed, i: int) -> str:
        return index.names.text(i)

    def path(self, index: Indexed, i: int) -> Path:
        rows = _rows(index)
        return index.root / rows.files[int(rows.sample_file[i])]

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> ArrowReader:
        return ArrowReader(open_files(index, storage, max_bytes, heard), index.names, _rows(index), max_bytes)


def _listing(data: Location) -> Listing:
    """The folder's data files, from its ``state.json``: local, or objects beside the store's one."""
    if not data.in_store:
        root = data.path.parent if data.path.name == STATE else data.path
        if not root.is_dir():
            raise DatasetError(f"datasets folder {root} does not exist")
        names = data_files(root)
        for name in names:
            if not (root / name).is_file():
                raise DatasetError(f"{root / STATE} lists {name}, which is not in {root}")
        return LocalListing(root, names)
    url = data.text.rstrip("/")
    state_url = url if url.endswith("/" + STATE) else f"{url}/{STATE}"
    state = store_object(state_url, data.storage)
    names = listed_files(RangedFile(state.bucket, state.objects[0]).read(), state_url)
    objects = [store_object(f"{state.url}/{name}", data.storage).objects[0] for name in names]
    return StoreObjects(state.url, names, tuple(objects), state.bucket, data.storage)


def _rows(index: Indexed) -> ArrowRows:
    assert isinstance(index.part, ArrowRows), "an arrow index holds its rows"
    return index.part


FORMAT: Format = ArrowFormat()
