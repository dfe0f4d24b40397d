"""Read a sample's bytes in a decode worker, whatever its source: the index's format opens the reader
(``dataset.formats``), and a sample found flawed when it was indexed is refused before it is read.

Every failure is a ``DecodeError`` whose text is the reason: one bad sample costs that sample only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loader_service.dataset.format import Metadata
from loader_service.dataset.formats import format_named
from loader_service.dataset.index import LOCAL, DatasetIndex
from loader_service.dataset.sources import FeedSources
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from protocol.pixels import DecodeError


class SampleReader:
    def __init__(
        self, index: DatasetIndex, max_bytes: int, storage: StorageConfig = LOCAL, heard: Heard | None = None
    ) -> None:
        """``heard``: told of each answer of the data's store to this reader's reads (a decode
        worker's progress page, NOTE [ Waiting on the store ])."""
        self.index = index
        self.max_bytes = max_bytes
        self._reader = format_named(index.kind).reader(index, max_bytes, storage, heard)

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


class FeedReader:
    """A feed's samples by feed number, each read by its own source's reader (NOTE [ Sources of a
    feed ]); the same interface as ``SampleReader``."""

    def __init__(
        self, sources: FeedSources, max_bytes: int, storage: StorageConfig = LOCAL, heard: Heard | None = None
    ) -> None:
        self.sources = sources
        self._readers = [SampleReader(index, max_bytes, storage, heard) for index in sources.indexes]

    def prefetch(self, indices: Sequence[int]) -> None:
        """Each source's share of ``indices``, fetched at once from its store (nothing for local data)."""
        inside = np.asarray([i for i in indices if 0 <= i < len(self.sources)], np.int64)
        source, local = self.sources.split(inside)
        for s, reader in enumerate(self._readers):
            mine = local[source == s]
            if mine.size:
                reader.prefetch(mine.tolist())

    def image_bytes(self, i: int) -> bytes:
        s, j = self.sources.locate(i)
        return self._readers[s].image_bytes(j)

    def metadata(self, i: int) -> Metadata:
        s, j = self.sources.locate(i)
        return self._readers[s].metadata(j)

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
