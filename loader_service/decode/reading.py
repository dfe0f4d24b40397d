"""Read a sample's bytes in a decode worker, whatever its source: the index's format opens the reader
(``dataset.formats``), and a sample found flawed when it was indexed is refused before it is read.

Every failure is a ``DecodeError`` whose text is the reason: one bad sample costs that sample only.
"""

from __future__ import annotations

from collections.abc import Sequence

from loader_service.dataset.formats import source
from loader_service.dataset.index import LOCAL, DatasetIndex
from loader_service.dataset.source import Metadata
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DecodeError


class SampleReader:
    def __init__(
        self, index: DatasetIndex, max_bytes: int, storage: StorageConfig = LOCAL, heard: Heard | None = None
    ) -> None:
        """``heard``: told of each answer of the data's store to this reader's reads (a decode
        worker's progress page, NOTE [ Waiting on the store ])."""
        self.index = index
        self.max_bytes = max_bytes
        self._reader = source(index.kind).reader(index, max_bytes, storage, heard)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Fetch the images of ``indices`` from an object store at once (NOTE [ Object store reads ]);
        StoreUnavailable if it does not answer. Nothing for local data."""
        if self.index.url:
            self._reader.prefetch(
                [i for i in indices if 0 <= i < len(self.index) and i not in self.index.flaws]
            )

    def image_bytes(self, i: int) -> bytes:
        """The sample's image file, or the bytes its format holds the image in."""
        self._check_flaw(i)
        return self._reader.image_bytes(i)

    def metadata(self, i: int) -> Metadata:
        """Every metadata item of sample ``i`` by name, each read when called: a list's other columns
        (csv: strings) or keys (jsonl: JSON values), a tar sample's members other than its image
        (bytes, by extension). A sample flawed at indexing raises DecodeError here too, so a pipeline
        that reads neither image nor bytes still skips it."""
        self._check_flaw(i)
        return self._reader.metadata(i)

    def close(self) -> None:
        self._reader.close()

    def _check_flaw(self, i: int) -> None:
        flaw = self.index.flaws.get(i)
        if flaw is not None:
            raise DecodeError(flaw)
