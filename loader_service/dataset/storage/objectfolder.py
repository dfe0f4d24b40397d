"""The files of a format in an object store: which objects a ``--data`` URL names (one object, a brace
pattern of them, or those directly under a prefix), and each as a local file for a scan.

A tar shard has no table of contents, so indexing reads each one whole (and a Parquet file, when
there is a cache folder to keep it in): it is streamed into a temporary file (``FETCH_AHEAD`` at
once, in threads, while the one before is scanned), scanned as a local file is, then kept in the
cache folder if there is one and it has room (NOTE [ Fetch cache ]), else removed. An object the
cache already holds is not fetched again. The index records each object's size and ETag: the
workers' reads name the ETag, and a saved index is used again only while every ETag is the same
(NOTE [ Saved indexes ]).
"""

from __future__ import annotations

import contextlib
import io
import logging
import posixpath
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader_service.dataset.storage.cachedir import FetchCache
from loader_service.dataset.storage.objectstore import SCAN_DEADLINE, Bucket, ObjectInfo
from loader_service.dataset.storage.patterns import (
    COMPRESSED_SUFFIXES,
    TAR_SUFFIX,
    expand_braces,
    is_brace_pattern,
)
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import FULL_ERRNOS, LocalDiskFull
from loader_service.dataset.storage.urls import split_url
from loader_service.dataset.tables import DatasetError
from loader_service.shm import scratch_folder

log = logging.getLogger(__name__)

FETCH_AHEAD = 4
"""Shards fetched at once while indexing: enough to hide a store's latency, few enough for the
temporary disk they take."""


@dataclass(frozen=True)
class StoreObjects:
    """The objects a ``--data`` URL names, in the order their samples are numbered."""

    url: str
    """The folder URL the names are relative to."""
    names: tuple[str, ...]
    objects: tuple[ObjectInfo, ...]
    bucket: Bucket
    storage: StorageConfig
    root: Path = Path(".")
    """Local names' root, which a store's objects do not have (``dataset.storage.listing``)."""

    def stamps(self) -> list[list[Any]] | None:
        """Each object's name, size and ETag; None (do not save the index) if one has no ETag."""
        if not all(o.etag for o in self.objects):
            return None
        return [[name, o.size, o.etag] for name, o in zip(self.names, self.objects, strict=True)]

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def size(self, name: str) -> int | None:
        return self.objects[self.names.index(name)].size

    @property
    def folder(self) -> str:
        return self.url

    def versions(self) -> dict[str, tuple[int, str]]:
        """What the index records of each object: (size, ETag), by name."""
        return {name: (o.size, o.etag) for name, o in zip(self.names, self.objects, strict=True)}

    def sources(self) -> Generator[tuple[str, Any], None, None]:
        """Each object for a reader of ranges (pyarrow): its local copy when there is a cache
        folder (fetched once, kept), else the object itself, read by range."""
        if self.storage.cache_dir:
            with contextlib.closing(self.local_copies()) as copies:  # a failed scan's files go now
                yield from ((name, str(path)) for name, path in copies)
        else:
            yield from zip(self.names, (RangedFile(self.bucket, o) for o in self.objects), strict=True)

    def ranges(self) -> Generator[tuple[str, Any], None, None]:
        """Each object read by range, never fetched whole (even with a cache folder)."""
        yield from zip(self.names, (RangedFile(self.bucket, o) for o in self.objects), strict=True)

    def local_copies(self) -> Generator[tuple[str, Path], None, None]:
        """Each object as a local file, in order; fetched ``FETCH_AHEAD`` ahead and, once scanned,
        kept in the cache or removed."""
        cache = FetchCache.of(self.storage)
        pending: deque[Future[tuple[Path, bool]]] = deque()
        scratches = contextlib.ExitStack()
        try:
            scratch = scratches.enter_context(scratch_folder("scan", cache.scratch() if cache else None))
        except OSError as exc:  # the cache's disk is full: not even a folder fits
            if cache is None or exc.errno not in FULL_ERRNOS:
                raise
            scratch, cache = self._without_cache(cache, exc, pending, scratches), None
        pool = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="fetch")
        try:
            ahead = iter(range(len(self.names)))
            for k in range(len(self.names)):
                while len(pending) < FETCH_AHEAD and (nxt := next(ahead, None)) is not None:
                    pending.append(pool.submit(self._local_copy, nxt, cache, scratch))
                try:
                    path, held = pending.popleft().result()
                except LocalDiskFull as exc:
                    if cache is None:
                        raise
                    scratch, cache = self._without_cache(cache, exc, pending, scratches), None
                    ahead = iter(range(k, len(self.names)))  # this one and those after it, again
                    pending.append(pool.submit(self._local_copy, next(ahead), None, scratch))
                    path, held = pending.popleft().result()
                yield self.names[k], path
                if not held:
                    self._keep_or_remove(k, path, cache)
                if (k + 1) % 100 == 0:
                    log.info("indexing %s: %d of %d objects read", self.url, k + 1, len(self.names))
        finally:
            # On a failed scan the fetches not started are dropped, not waited for; those under way
            # end at their deadline at most, before their files go.
            pool.shutdown(wait=True, cancel_futures=True)
            scratches.close()

    def _without_cache(
        self,
        cache: FetchCache,
        exc: Exception,
        pending: deque[Future[tuple[Path, bool]]],
        scratches: contextlib.ExitStack,
    ) -> Path:
        """The cache folder's disk is full: the scan goes on in a folder of the system's temporary
        folder (returned), keeping nothing (the cache is an optimisation; a full disk must not stop
        the service)."""
        log.warning(
            "cache folder %s: its disk is full (%s); indexing %s goes on without keeping what it fetches",
            cache.dir,
            exc,
            self.url,
        )
        for future in pending:
            future.cancel()
        for future in pending:  # those already under way write into the old scratch, then are dropped
            with contextlib.suppress(Exception):
                future.result()
        pending.clear()
        return scratches.enter_context(scratch_folder("scan"))

    def _local_copy(self, k: int, cache: FetchCache | None, scratch: Path) -> tuple[Path, bool]:
        """The shard's file, and whether the cache held it already."""
        obj = self.objects[k]
        held = cache.holds(self._url(k), obj.etag, obj.size) if cache else None
        if held is not None:
            return held, True
        path = scratch / str(k)
        self.bucket.download(obj, path)
        return path, False

    def _keep_or_remove(self, k: int, path: Path, cache: FetchCache | None) -> None:
        obj = self.objects[k]
        if cache is None or not cache.adopt(path, self._url(k), obj.etag, obj.size):
            path.unlink(missing_ok=True)

    def _url(self, k: int) -> str:
        return f"{self.bucket.url}/{self.objects[k].key}"


class RangedFile(io.RawIOBase):
    """An object in a store as a read-only file pyarrow reads by range (its footer, a column)."""

    def __init__(self, bucket: Bucket, obj: ObjectInfo) -> None:
        self.bucket, self.obj, self.pos = bucket, obj, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self.obj.size - self.pos)
        if size <= 0:
            return 0
        data = self.bucket.read_now(self.obj.key, self.pos, size, self.obj.etag)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


Suffix = str | Callable[[str], bool]
"""How a folder's objects of a format are told: by the end of their names, or a test of the name."""


def store_objects(data: str, storage: StorageConfig, suffix: Suffix, what: str) -> StoreObjects:
    """The objects of a URL: one object, a brace pattern of them, or the ``suffix`` objects directly
    under a prefix (as a local folder's, not its sub-folders'); ``what`` they are, for messages.
    ``suffix`` may be a test of a name instead (TFRecord files need not have one)."""
    bucket = Bucket(data, storage, SCAN_DEADLINE)
    _, key = split_url(data)
    if is_brace_pattern(data):
        keys = [split_url(url)[1] for url in expand_braces(data)]
        folder = posixpath.commonpath([posixpath.dirname(k) for k in keys])
        listed = {o.key: o for o in bucket.list(_as_prefix(folder))}
        missing = [k for k in keys if k not in listed]
        if missing:
            raise DatasetError(f"{what} {bucket.url}/{missing[0]} does not exist ({len(missing)} missing)")
        objects = [listed[k] for k in keys]
    elif key and not key.endswith("/") and posixpath.splitext(key)[1]:
        return _one(bucket, key, storage)
    else:
        folder = key.strip("/")
        objects = _in_folder(bucket, folder, suffix, what)
    return _under(folder, objects, bucket, storage)


def store_object(data: str, storage: StorageConfig) -> StoreObjects:
    """The one object a URL names, whatever its name."""
    return _one(Bucket(data, storage, SCAN_DEADLINE), split_url(data)[1], storage)


def _one(bucket: Bucket, key: str, storage: StorageConfig) -> StoreObjects:
    return _under(posixpath.dirname(key), [bucket.head(key)], bucket, storage)


def _under(folder: str, objects: list[ObjectInfo], bucket: Bucket, storage: StorageConfig) -> StoreObjects:
    root = f"{bucket.url}/{folder}" if folder else bucket.url
    names = tuple(posixpath.relpath(o.key, folder or ".") for o in objects)
    return StoreObjects(root, names, tuple(objects), bucket, storage)


def _as_prefix(folder: str) -> str:
    return f"{folder}/" if folder else ""


def _in_folder(bucket: Bucket, folder: str, suffix: Suffix, what: str) -> list[ObjectInfo]:
    prefix = _as_prefix(folder)
    here = [o for o in bucket.list(prefix) if "/" not in o.key[len(prefix) :]]
    found = [o for o in here if (suffix(o.key) if callable(suffix) else o.key.endswith(suffix))]
    if found:
        return found
    where = f"{bucket.url}/{prefix}"
    if suffix == TAR_SUFFIX:
        compressed = [posixpath.basename(o.key) for o in here if o.key.lower().endswith(COMPRESSED_SUFFIXES)]
        if compressed:
            raise DatasetError(
                f"{where} holds only compressed shards ({', '.join(compressed[:3])}...): dataferry reads "
                "members in place, so shards must be uncompressed .tar files (decompress them once)"
            )
    raise DatasetError(f"no {what} in {where}" if callable(suffix) else f"no {suffix} {what} in {where}")
