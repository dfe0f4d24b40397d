"""Tar shards in an object store: which objects they are, and their index.

A shard in a store has no table of contents, so indexing reads each one whole: it is streamed into a
temporary file (``FETCH_AHEAD`` of them at once, in threads, while the one before is scanned),
scanned as a local shard is (NOTE [ Damaged tar shards ] and all), then kept in the cache folder if
there is one and it has room (NOTE [ Fetch cache ]), else removed. A shard the cache already holds
is not fetched again. The index records each shard's size and ETag: the workers' reads name the
ETag, and a saved index is used again only while every ETag is the same (NOTE [ Saved indexes ]).
"""

from __future__ import annotations

import logging
import posixpath
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader_service.dataset.cachedir import FetchCache
from loader_service.dataset.remote import SCAN_DEADLINE, Bucket, ObjectInfo, StorageConfig, split_url
from loader_service.dataset.shards import COMPRESSED_SUFFIXES, TAR_SUFFIX, expand_braces, is_brace_pattern
from loader_service.dataset.source import Progress, Scanned
from loader_service.dataset.tables import DatasetError

log = logging.getLogger(__name__)

FETCH_AHEAD = 4
"""Shards fetched at once while indexing: enough to hide a store's latency, few enough for the
temporary disk they take."""


@dataclass(frozen=True)
class RemoteShards:
    """The shards a ``--data`` URL names, in the order their samples are numbered."""

    root: str
    """The folder URL the names are relative to."""
    names: tuple[str, ...]
    objects: tuple[ObjectInfo, ...]
    bucket: Bucket
    storage: StorageConfig

    def inputs(self) -> list[list[Any]]:
        return [[name, o.size, o.etag] for name, o in zip(self.names, self.objects, strict=True)]

    def scan(self, progress: Progress | None) -> Scanned:
        from loader_service.dataset.tarshards import scan_files  # it imports this module

        found = scan_files(self._fetched(), self.names, self.root, progress)
        versions = {name: (o.size, o.etag) for name, o in zip(self.names, self.objects, strict=True)}
        return Scanned(
            Path("."), (), found.labels, found.keys, found.members, found.flaws, self.root, versions
        )

    def _fetched(self) -> Iterator[tuple[str, Path]]:
        """Each shard as a local file, in order; fetched ``FETCH_AHEAD`` ahead and, once scanned,
        kept in the cache or removed."""
        cache = (
            FetchCache(self.storage.cache_dir, self.storage.cache_size) if self.storage.cache_dir else None
        )
        scratch = Path(tempfile.mkdtemp(prefix="dataferry-scan-", dir=cache.tmp if cache else None))
        pending: deque[Future[tuple[Path, bool]]] = deque()
        try:
            with ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="fetch") as pool:
                ahead = iter(range(len(self.names)))
                for k in range(len(self.names)):
                    while len(pending) < FETCH_AHEAD and (nxt := next(ahead, None)) is not None:
                        pending.append(pool.submit(self._local_copy, nxt, cache, scratch))
                    path, held = pending.popleft().result()
                    yield self.names[k], path
                    if not held:
                        self._keep_or_remove(k, path, cache)
                    if (k + 1) % 100 == 0:
                        log.info("indexing %s: %d of %d shards read", self.root, k + 1, len(self.names))
        finally:
            for future in pending:
                future.cancel()
            shutil.rmtree(scratch, ignore_errors=True)

    def _local_copy(self, k: int, cache: FetchCache | None, scratch: Path) -> tuple[Path, bool]:
        """The shard's file, and whether the cache held it already."""
        obj = self.objects[k]
        held = cache.holds(self._url(k), obj.etag, obj.size) if cache else None
        if held is not None:
            return held, True
        path = scratch / f"{k}.tar"
        self.bucket.download(obj, path)
        return path, False

    def _keep_or_remove(self, k: int, path: Path, cache: FetchCache | None) -> None:
        obj = self.objects[k]
        if cache is None or not cache.adopt(path, self._url(k), obj.etag, obj.size):
            path.unlink(missing_ok=True)

    def _url(self, k: int) -> str:
        return f"{self.bucket.url}/{self.objects[k].key}"


def remote_shards(data: str, storage: StorageConfig) -> RemoteShards:
    """The shards of a URL: one ``.tar`` object, a brace pattern of them, or the ``.tar`` objects
    directly under a prefix (as a local folder's, not its sub-folders')."""
    bucket = Bucket(data, storage, SCAN_DEADLINE)
    _, key = split_url(data)
    if is_brace_pattern(data):
        keys = [split_url(url)[1] for url in expand_braces(data)]
        folder = posixpath.commonpath([posixpath.dirname(k) for k in keys])
        listed = {o.key: o for o in bucket.list(_as_prefix(folder))}
        missing = [k for k in keys if k not in listed]
        if missing:
            raise DatasetError(f"shard {bucket.url}/{missing[0]} does not exist ({len(missing)} missing)")
        objects = [listed[k] for k in keys]
    elif key.lower().endswith((TAR_SUFFIX, *COMPRESSED_SUFFIXES)):
        folder = posixpath.dirname(key)
        objects = [bucket.head(key)]
    else:
        folder = key.strip("/")
        objects = _folder_shards(bucket, folder)
    root = f"{bucket.url}/{folder}" if folder else bucket.url
    names = tuple(posixpath.relpath(o.key, folder or ".") for o in objects)
    return RemoteShards(root, names, tuple(objects), bucket, storage)


def _as_prefix(folder: str) -> str:
    return f"{folder}/" if folder else ""


def _folder_shards(bucket: Bucket, folder: str) -> list[ObjectInfo]:
    prefix = _as_prefix(folder)
    here = [o for o in bucket.list(prefix) if "/" not in o.key[len(prefix) :]]
    shards = [o for o in here if o.key.endswith(TAR_SUFFIX)]
    if shards:
        return shards
    where = f"{bucket.url}/{prefix}"
    compressed = [posixpath.basename(o.key) for o in here if o.key.lower().endswith(COMPRESSED_SUFFIXES)]
    if compressed:
        raise DatasetError(
            f"{where} holds only compressed shards ({', '.join(compressed[:3])}...): dataferry reads "
            "members in place, so shards must be uncompressed .tar files (decompress them once)"
        )
    raise DatasetError(f"no .tar shards in {where}")
