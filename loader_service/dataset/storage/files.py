"""A reader's files, wherever they are: the one place that tells local data from a store's."""

from __future__ import annotations

from loader_service.dataset.format import Indexed
from loader_service.dataset.storage.local import Files, LocalFiles
from loader_service.dataset.storage.objectfiles import ObjectFiles
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig


def open_files(index: Indexed, storage: StorageConfig, max_bytes: int, heard: Heard | None = None) -> Files:
    """The files of ``index``'s data, wherever they are; a whole file over ``max_bytes`` is refused
    having read no more than that (and one chunk). ``heard`` is told of each answer of a store."""
    if index.url:
        return ObjectFiles(index.url, storage, index.versions, max_bytes, heard)
    return LocalFiles(index.root)
