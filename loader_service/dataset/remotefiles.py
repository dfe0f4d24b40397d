"""A decode worker's reads from an object store (``storage.Files`` for remote data; NOTE [ Object
store reads ]), through the cache folder when it holds the object (NOTE [ Fetch cache ])."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from loader_service.dataset.cachedir import FetchCache
from loader_service.dataset.remote import (
    Bucket,
    NotFetched,
    Requests,
    StorageConfig,
    StoreUnavailable,
    join_url,
    sample_error,
    split_url,
)
from loader_service.dataset.storage import DecodeError, LocalFiles, Want


class RemoteFiles:
    """Objects under the folder URL ``root``. ``versions`` gives the (size, ETag) the index saw of
    the objects read by range; each read names that ETag, and only those objects are read from the
    cache folder."""

    def __init__(
        self, root: str, storage: StorageConfig, versions: Mapping[str, tuple[int, str]], max_bytes: int
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.storage = storage
        self.versions = versions
        self._buckets: dict[str, Bucket] = {}
        self._requests = Requests(storage.read_deadline)
        self._cache = FetchCache.of(storage)
        self._entries = LocalFiles(Path("/"))
        self._got: dict[Want, bytes | Exception] = {}
        self._entries_of: dict[str, Path | None] = {}

    def read(self, name: str, max_bytes: int) -> bytes:
        data = self._take((name, 0, -1))
        if len(data) > max_bytes:
            raise DecodeError(f"object of {len(data)} bytes is over --max-file-bytes {max_bytes}")
        if not data:
            raise DecodeError(f"{join_url(self.root, name)}: empty object")
        return data

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        entry = self._entry(name)
        if entry is not None:
            return self._entries.read_range(str(entry), offset, size)
        return self._take((name, offset, size))

    def prefetch(self, wanted: Sequence[Want]) -> None:
        """Fetch every range of ``wanted`` the cache does not hold, at once, in place of what the
        last call fetched; StoreUnavailable if the store does not answer within the deadline."""
        self._got.clear()
        self._fetch_now([w for w in dict.fromkeys(wanted) if self._entry(w[0]) is None])

    def _fetch_now(self, todo: Sequence[Want]) -> None:
        """Add ``todo``'s results (data, or the sample's error) to what is held. A read the store
        failed or the deadline stopped is not held: it is asked for again alone when it is read.
        StoreUnavailable if none finished."""
        if not todo:
            return
        results = self._requests.run([functools.partial(self._fetch, w) for w in todo])
        for want, result in zip(todo, results, strict=True):
            got = self._outcome(want, result)
            if not isinstance(got, (NotFetched, StoreUnavailable)):
                self._got[want] = got

    def close(self) -> None:
        self._entries.close()
        self._requests.close()
        self._got.clear()

    def _take(self, want: Want) -> bytes:
        """The bytes of ``want``: held since the last prefetch (kept until the next: a Parquet page
        serves several rows), else read alone now (a tar sample's metadata, a read that failed)."""
        got = self._got.get(want)
        if got is None:
            (result,) = self._requests.run([functools.partial(self._fetch, want)])
            got = self._outcome(want, result)
            if isinstance(got, StoreUnavailable):
                raise got
            self._got[want] = got
        if isinstance(got, Exception):
            raise got
        return got

    def _outcome(self, want: Want, result: bytes | BaseException) -> bytes | Exception:
        """A read's bytes, or what its failure is (``sample_error``)."""
        if not isinstance(result, BaseException):
            return result
        if isinstance(result, (DecodeError, StoreUnavailable, NotFetched)):
            return result
        if isinstance(result, Exception):
            return sample_error(result, join_url(self.root, want[0]))
        raise result  # KeyboardInterrupt and the like are not a sample's

    async def _fetch(self, want: Want) -> bytes:
        name, offset, size = want
        url = join_url(self.root, name)
        version = self.versions.get(name)
        etag = version[1] if version else ""
        return await self._bucket(url).read(split_url(url)[1], offset, size, etag, self.max_bytes)

    def is_local(self, name: str) -> bool:
        """Whether ``name`` is read from the cache folder, not the store."""
        return self._entry(name) is not None

    def _entry(self, name: str) -> Path | None:
        """The cache folder's copy of ``name``, looked up once: copies are kept by the index scan,
        before any worker starts, and none is removed while the service runs."""
        if name not in self._entries_of:
            version = self.versions.get(name)
            held = None
            if self._cache is not None and version is not None:
                held = self._cache.holds(join_url(self.root, name), version[1], version[0])
            self._entries_of[name] = held
        return self._entries_of[name]

    def _bucket(self, url: str) -> Bucket:
        base, _ = split_url(url)
        bucket = self._buckets.get(base)
        if bucket is None:
            bucket = self._buckets[base] = Bucket(base, self.storage, self.storage.read_deadline)
        return bucket
