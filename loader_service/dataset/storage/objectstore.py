"""Object stores: ``s3://``, ``gs://`` and ``az://`` data, read through obstore (the Rust
``object_store`` crate's binding), an optional extra: ``pip install 'dataferry[cloud]'``.

Credentials and endpoints come the standard way of each store (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, instance roles; ``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_*``), and
``--storage-option KEY=VALUE`` (a ``[storage]`` table in the config file) says what the environment
cannot. Option values are never logged: they may hold secrets.

NOTE [ Object store reads ]
    A worker asks for every byte range its task needs at once (``ObjectFiles.prefetch``), so the
    store's latency is paid about once a batch, not once a sample. Each read of a shard or Parquet
    file names the ETag the index saw (``If-Match``): an object replaced since is a bad sample named
    by its URL, as is one that is gone (404), and any answer asking again cannot change (403, 400, a
    key the store refuses). Everything else (a timeout, a reset, a 5xx, 429, a store that is down) is
    retried with backoff by obstore, within ``StorageConfig.read_deadline``, kept under the task
    timeout, and every answer starts the worker's task timeout again, so that a worker waiting on
    the store is never taken for a hung decoder (NOTE [ Waiting on the store ]). Reads the
    deadline stopped are asked for again one at a time as their samples come up, so a slow store
    still makes progress; when none finished, or one alone fails again, ``StoreUnavailable`` makes
    the worker hand its task back undone, and the service does it again later
    (``TaskDone.retry``): a store that is down for a while delays batches and loses no sample.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from loader_service.dataset.storage.storeconfig import CLIENT_KEYS, ENV_PREFIXES, StorageConfig
from loader_service.dataset.storage.storeerrors import (
    StorageError,
    denied,
    first_line,
    local_write_error,
    not_found,
)
from loader_service.dataset.storage.urls import split_url
from loader_service.dataset.tables import DatasetError
from protocol.pixels import DecodeError

SCAN_DEADLINE = 120.0
"""Seconds the service's own requests (listing, fetching shards to index them) retry for."""
DOWNLOAD_CHUNK = 8 << 20
READ_CHUNK = 256 << 10
"""Bytes a worker's whole-object read takes at a time."""

Admit = Callable[[int], Awaitable[None]]
"""Asked before a read holds this many bytes; raises to drop the read unread (``Bucket.read``)."""
Heard = Callable[[], None]
"""Called each time the store answers one of a bucket's reads: a request's headers, and each chunk
of a streamed object. A decode worker counts them on its progress page (NOTE [ Waiting on the
store ] in decode/progress.py): waiting on a store that answers is not a hang."""


def _nobody() -> None:
    pass


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    """The object's key in its bucket."""
    size: int
    etag: str


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise DatasetError(
            "reading from an object store needs obstore: pip install 'dataferry[cloud]'"
        ) from None
    return obstore


class Bucket:
    """One bucket (container) of an object store, with retries bounded by ``deadline`` seconds."""

    def __init__(self, url: str, storage: StorageConfig, deadline: float, heard: Heard | None = None) -> None:
        self.url, _ = split_url(url)
        self._heard = heard or _nobody
        self._obs = _obstore()
        self.store = _open_store(self._obs, self.url, storage, deadline)

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, by key."""
        found: list[ObjectInfo] = []
        try:
            for chunk in self._obs.list(self.store, prefix or None, chunk_size=1000):
                found.extend(_info(meta) for meta in chunk)
        except Exception as exc:
            raise self.start_error(exc, prefix) from None
        return sorted(found, key=lambda o: o.key)

    def head(self, key: str) -> ObjectInfo:
        try:
            return _info(self._obs.head(self.store, key))
        except Exception as exc:
            raise self.start_error(exc, key) from None

    def download(self, obj: ObjectInfo, dest: Path) -> None:
        """Stream ``obj`` into the new file ``dest``, never more than its listed size; StorageError if
        it fails or comes out short or long, and DatasetError naming ``dest`` if it cannot be
        written (obstore's 404 is an OSError too)."""
        try:
            opened = open(dest, "xb")  # noqa: SIM115 (closed by the with below)
        except OSError as exc:
            raise local_write_error(exc, f"cannot write {dest}") from None
        with opened as out:
            try:
                got = self._obs.get(self.store, obj.key, options=_if_match(obj.etag))
                for chunk in got.stream(min_chunk_size=DOWNLOAD_CHUNK):
                    room = obj.size - out.tell()
                    _write(out, memoryview(chunk)[:room])  # a store may send more than it listed
                    if len(chunk) > room:
                        raise StorageError(
                            f"{self.url}/{obj.key}: the store sent more than the {obj.size} bytes it "
                            "listed (changed since?); stopped there"
                        )
            except _LocalWrite as exc:
                raise local_write_error(exc.error, f"cannot write {dest}") from None
            except StorageError:
                raise
            except Exception as exc:
                raise self.start_error(exc, obj.key) from None
            written = out.tell()
        if written != obj.size:
            raise StorageError(f"{self.url}/{obj.key}: read {written} bytes of {obj.size}")

    def read_now(self, key: str, start: int, size: int, etag: str) -> bytes:
        """``read``, for the service's own scans: StorageError if it fails."""
        options: dict[str, Any] = {**_if_match(etag), "range": (start, start + size)}
        try:
            return bytes(self._obs.get(self.store, key, options=options).bytes())
        except Exception as exc:
            raise self.start_error(exc, key) from None

    async def read(
        self, key: str, start: int, size: int, etag: str, limit: int, admit: Admit | None = None
    ) -> bytes:
        """``size`` bytes from ``start``, or for ``size`` -1 the whole object, of no more than
        ``limit`` bytes (whoever wrote the object decides its size); errors as obstore's. ``admit``
        is asked before any byte is held: for a range before it is asked for, for a whole object
        once the answer's headers state its size (NOTE [ Prefetch budget ] in storage/objectfiles.py)."""
        options: dict[str, Any] = _if_match(etag)
        if size >= 0:
            options["range"] = (start, start + size)
            if admit is not None:
                await admit(size)
        got = await self._obs.get_async(self.store, key, options=options)
        self._heard()
        if size >= 0:
            data = bytes(await got.bytes_async())
            self._heard()
            return data
        stated = int(got.meta["size"])
        if stated > limit:  # refused on the answer's word, its body unread
            raise DecodeError(f"object of {stated} bytes is over --max-file-bytes {limit}")
        if admit is not None:
            await admit(stated)
        return await _body(got, stated, self._heard)

    def start_error(self, exc: Exception, key: str) -> DatasetError:
        """What an error met at start says: StorageError (exit 2) naming the bucket and the cause."""
        where = f"{self.url}/{key}" if key else self.url
        kind = type(exc).__name__
        if kind in ("PermissionDeniedError", "UnauthenticatedError") or denied(exc):
            return StorageError(
                f"{self.url}: access denied: check the credentials (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a role, or --storage-option) and the bucket's policy"
            )
        if not_found(exc):
            return StorageError(f"{where} does not exist")
        if "builder error" in str(exc):  # what object_store says of an http:// endpoint it may not use
            return StorageError(
                f"{where}: {first_line(exc)}: for an http:// endpoint set AWS_ALLOW_HTTP=true "
                "or --storage-option allow_http=true"
            )
        return StorageError(f"{where}: {first_line(exc)}")


async def _body(got: Any, stated: int, heard: Heard) -> bytes:
    """A whole object's body, never more than the ``stated`` size it was admitted at."""
    parts, total = [], 0
    async for chunk in got.stream(min_chunk_size=READ_CHUNK):
        heard()
        parts.append(bytes(chunk))
        total += len(parts[-1])
        if total > stated:
            raise DecodeError(f"the store sent more than the {stated} bytes it said the object has")
    return b"".join(parts)


def _open_store(obs: Any, url: str, storage: StorageConfig, deadline: float) -> Any:
    config = {k: v for k, v in storage.options if k not in CLIENT_KEYS}
    client: dict[str, Any] = {"connect_timeout": "5s", "timeout": f"{max(1, int(deadline))}s"}
    # Client options given here replace those obstore would read from the environment (such as
    # AWS_ALLOW_HTTP), so the environment's are read here too; --storage-option wins over both.
    prefix = ENV_PREFIXES[url.partition("://")[0]]
    client.update((k, v) for k in CLIENT_KEYS if (v := os.environ.get(f"{prefix}{k.upper()}")) is not None)
    client.update((k, v) for k, v in storage.options if k in CLIENT_KEYS)
    retry = {
        "max_retries": 1000,  # the deadline bounds them
        "retry_timeout": timedelta(seconds=deadline),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
    }
    try:
        return obs.store.from_url(url, config=config, client_options=client, retry_config=retry)
    except Exception as exc:
        raise StorageError(f"{url}: {first_line(exc)} (check --storage-option)") from None


class _LocalWrite(Exception):
    """Writing a fetched object to local disk failed: this host's problem, not the store's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


def _write(out: Any, chunk: Any) -> None:
    try:
        out.write(chunk)
    except OSError as exc:
        raise _LocalWrite(exc) from None


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(str(meta["path"]), int(meta["size"]), str(meta.get("e_tag") or ""))


def _if_match(etag: str) -> dict[str, Any]:
    return {"if_match": etag} if etag else {}
