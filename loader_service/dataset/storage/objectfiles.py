"""A decode worker's reads from an object store (``storage.Files`` for remote data; NOTE [ Object
store reads ]), through the cache folder when it holds the object (NOTE [ Fetch cache ]).

NOTE [ Prefetch budget ]
    A task's reads are asked for at once, but a worker holds at most ``PREFETCH_BYTES`` of what
    they return: the reads go out in windows of that many bytes, in the order the task reads them,
    and the next window is fetched when a sample reaches it, dropping the last. Before, a task's
    every byte was held until its end: 32 images of 8 MiB held 256 MiB in one worker, and a batch
    of 64 larger ones could take a worker past its memory while nothing was yet decoding, an OOM
    kill the batch's redo met again. A read weighs its range, or the object's size where the index
    has it; an object whose size the index does not know (one a list names) weighs the mean of
    those fetched so far, and an eighth of the budget before any (so a fresh worker's first window
    holds eight at most). One object larger than the budget is a window of its own;
    ``--max-file-bytes`` bounds it. Moving to the next window drops what the last one held, so a
    Parquet page two samples share across windows is read again, alone: a cost in requests, not in
    what is delivered.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from loader_service.dataset.storage.cachedir import FetchCache
from loader_service.dataset.storage.local import LocalFiles, Want
from loader_service.dataset.storage.objectstore import (
    Bucket,
    NotFetched,
    Requests,
    StorageConfig,
    StoreUnavailable,
    join_url,
    sample_error,
    split_url,
)
from loader_service.dataset.tables import DecodeError

PREFETCH_BYTES = 64 << 20
"""Bytes of fetched-ahead reads a worker holds at once (NOTE [ Prefetch budget ])."""
FIRST_GUESS = PREFETCH_BYTES // 8
"""What an object of unknown size is taken to weigh before any has been fetched: a fresh worker's
first window holds eight such objects at most, whatever their size turns out to be."""


class ObjectFiles:
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
        self._ahead: dict[Want, None] = {}
        """The task's reads not fetched yet, in the order it makes them (NOTE [ Prefetch budget ])."""
        self._unsized = [0, 0]
        """Bytes and count of the objects of unknown size fetched so far."""
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
        """Fetch the ranges of ``wanted`` the cache does not hold, at once up to ``PREFETCH_BYTES``
        and the rest as they come up, in place of what the last call fetched; StoreUnavailable if
        the store does not answer within the deadline."""
        self._got.clear()
        self._ahead = dict.fromkeys(w for w in wanted if self._entry(w[0]) is None)
        self._fetch_window()

    def _fetch_window(self, start: Want | None = None) -> None:
        """Fetch the next reads from ``start`` on (the first not fetched, if None), as many as fit
        the budget, dropping what is held (NOTE [ Prefetch budget ])."""
        if start is not None:
            self._got.clear()
            while self._ahead and next(iter(self._ahead)) != start:
                self._ahead.pop(next(iter(self._ahead)))  # a read the task skipped (a cached sample)
        window: list[Want] = []
        weight = 0
        while self._ahead:
            want = next(iter(self._ahead))
            if window and weight + self._weight(want) > PREFETCH_BYTES:
                break
            window.append(want)
            weight += self._weight(want)
            del self._ahead[want]
        self._fetch_now(window)

    def _weight(self, want: Want) -> int:
        """A read's bytes: its range, else the object's size as indexed, else the mean of the
        objects of unknown size fetched so far (NOTE [ Prefetch budget ])."""
        name, _, size = want
        if size >= 0:
            return size
        if name in self.versions:
            return self.versions[name][0]
        total, count = self._unsized
        return max(total // count, 1) if count else FIRST_GUESS

    def held_bytes(self) -> int:
        """Bytes of fetched-ahead reads held now."""
        return sum(len(got) for got in self._got.values() if isinstance(got, bytes))

    def _fetch_now(self, todo: Sequence[Want]) -> None:
        """Add ``todo``'s results (data, or the sample's error) to what is held. A read the store
        failed or the deadline stopped is not held: it is asked for again alone when it is read.
        StoreUnavailable if none finished."""
        if not todo:
            return
        results = self._requests.run([functools.partial(self._fetch, w) for w in todo])
        for want, result in zip(todo, results, strict=True):
            if want[2] < 0 and isinstance(result, bytes):
                self._unsized[0] += len(result)
                self._unsized[1] += 1
            got = self._outcome(want, result)
            if not isinstance(got, (NotFetched, StoreUnavailable)):
                self._got[want] = got

    def close(self) -> None:
        self._entries.close()
        self._requests.close()
        self._got.clear()
        self._ahead.clear()

    def _take(self, want: Want) -> bytes:
        """The bytes of ``want``: held since the last prefetch (kept until the next: a Parquet page
        serves several rows), else read alone now (a tar sample's metadata, a read that failed)."""
        got = self._got.get(want)
        if got is None and want in self._ahead:  # the task has reached the next window
            self._fetch_window(want)
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
