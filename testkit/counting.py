"""Readers that count what a service reads: the bytes of each range read of local files, and of each
read a worker makes of an object store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loader_service.dataset.storage import objectstore as remote
from loader_service.dataset.storage.local import LocalFiles


class CountingFiles(LocalFiles):
    """Local files, counting the bytes read by range: what an image costs beyond its own bytes."""

    bytes_read = 0

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        data = super().read_range(name, offset, size)
        self.bytes_read += len(data)
        return data


@contextmanager
def counted_store_reads() -> Iterator[list[int]]:
    """The bytes of every read a worker's reader makes of a store while the block runs, one a read:
    ``remote.Bucket.read`` wrapped, in this process."""
    fetched: list[int] = []
    real = remote.Bucket.read

    async def counting(
        self: remote.Bucket,
        key: str,
        start: int,
        size: int,
        etag: str,
        limit: int,
        admit: remote.Admit | None = None,
    ) -> bytes:
        data = await real(self, key, start, size, etag, limit, admit)
        fetched.append(len(data))
        return data

    remote.Bucket.read = counting  # type: ignore[method-assign]
    try:
        yield fetched
    finally:
        remote.Bucket.read = real  # type: ignore[method-assign]
