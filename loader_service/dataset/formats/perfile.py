"""What the formats whose samples are one file each (ImageFolder, lists) share: how a sample is
named and found, and its reader."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loader_service.dataset.format import Indexed, Metadata
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.local import Files
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import StringTable


class SampleFiles:
    """A reader of samples that are one file each, named relative to the data's root."""

    def __init__(self, files: Files, names: StringTable, max_bytes: int) -> None:
        self.files = files
        self.names = names
        self.max_bytes = max_bytes

    def image_bytes(self, i: int) -> bytes:
        return self.files.read(self.names.text(i), self.max_bytes)

    def metadata(self, i: int) -> Metadata:
        return {}

    def prefetch(self, indices: Sequence[int]) -> None:
        self.files.prefetch([(self.names.text(i), 0, -1) for i in indices])

    def close(self) -> None:
        self.files.close()


class FilePerSample:
    """A ``dataset.format.Format`` mixin: a sample is the file its name says, under the index's root."""

    def relpath(self, index: Indexed, i: int) -> str:
        return index.names.text(i)

    def path(self, index: Indexed, i: int) -> Path:
        return index.root / index.names.text(i)

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> SampleFiles:
        return SampleFiles(open_files(index, storage, max_bytes, heard), index.names, max_bytes)
