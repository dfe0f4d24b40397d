"""Where a feed's data is: a path on this host or an object in a store, told once.

NOTE [ One location ]
    ``--data`` names either files on this host or objects in a store (``s3://``, ``gs://``,
    ``az://``). ``Location.of`` tells which, once, where data enters: a feed's config, its checks,
    and the index's public functions (``build_index``, ``load_or_build``, ``resolve_format``). From
    there a ``Location`` travels: the format is detected through it, a format lists its files
    through it (NOTE [ One storage ]), and the index keeps the answer (``url``) for its readers
    (``files.open_files``). Nothing downstream asks a string whether it is a URL again, so local
    and store data cannot be told apart two ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.urls import in_object_store


@dataclass(frozen=True)
class Location:
    text: str
    """The path as given (``absolute()`` makes it absolute), or the store URL as given."""
    in_store: bool
    storage: StorageConfig = field(default_factory=StorageConfig)
    """How to reach the store and where its fetched files are kept (``--storage-option``,
    ``--cache-dir``); a local path uses only the cache folder of a saved index."""

    @classmethod
    def of(cls, data: str | Path | Location, storage: StorageConfig | None = None) -> Location:
        """Where ``data`` is; a ``Location`` stays itself, given ``storage`` if one is given."""
        if isinstance(data, Location):
            return data if storage is None else replace(data, storage=storage)
        text = str(data)
        return cls(text, in_object_store(text), storage or StorageConfig())

    def absolute(self) -> Location:
        """A local path made absolute (workers need not share our cwd); a URL as it is."""
        if self.in_store:
            return self
        return replace(self, text=str(Path(self.text).expanduser().resolve()))

    @property
    def path(self) -> Path:
        """The local path; only for a location not in a store."""
        assert not self.in_store, f"{self.text} is in an object store"
        return Path(self.text)

    def __str__(self) -> str:
        return self.text
