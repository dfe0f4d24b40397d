"""A decode worker's reads from an object store (``storage.Files`` for data in a store; NOTE [ Object
store reads ]), through the cache folder when it holds the object (NOTE [ Fetch cache ]).

NOTE [ Prefetch budget ]
    A task's reads are asked for at once, but a worker holds at most ``PREFETCH_BYTES`` of what
    they return: the reads go out in windows, in the order the task reads them, and the next window
    is fetched when a sample reaches it, dropping the last. Before, a task's every byte was held
    until its end: 32 images of 8 MiB held 256 MiB in one worker, and a batch of 64 larger ones
    could take a worker past its memory while nothing was yet decoding, an OOM kill the batch's
    redo met again.

    One rule bounds a window, whatever the index knows: in the task's order, a read holds its
    bytes only if they fit what is left of the budget, weighed as the store states them before
    any is read (a range by its length, before it is asked for; a whole object by the size its
    answer's headers give, before its body is read). A window's first read always holds, so each
    window makes progress; the first read with no room is dropped unread, and it and every read
    after it start the next window. A read made alone (one the deadline stopped, a tar sample's
    metadata) is kept only where it fits too. Worst case: a worker holds the budget, or one read
    alone where that read is larger (an object stated over ``--max-file-bytes`` is refused on
    its headers), and beside it the one object it is decoding, when that was read alone.

    How many reads a window asks for is a guess, and only that: a read's range, or the object's
    size where the index has it, else the size a dropped read's answer stated, else the mean of
    the objects of unknown size fetched so far, and an eighth of the budget before any. A guess
    too small costs requests dropped at their headers (at most ``MAX_CONCURRENT_READS`` at once,
    each wasting what of its body was already in flight, a socket buffer's worth at most), never
    bytes held. Before this rule the guess was the bound: after a task of small objects,
    their mean let 32 objects of 8 MiB be held at once against a 64 MiB budget (issue 35).
    Moving to the next window drops what the last one held, so a Parquet page two samples share
    across windows is read again, alone: a cost in requests, not in what is delivered.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from loader_service.dataset.storage.cachedir import FetchCache
from loader_service.dataset.storage.local import LocalFiles, Want
from loader_service.dataset.storage.objectstore import Bucket, Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import StoreUnavailable, sample_error
from loader_service.dataset.storage.urls import join_url, split_url
from protocol.pixels import DecodeError

MAX_CONCURRENT_READS = 64
"""Requests one worker has in flight at once."""
PREFETCH_BYTES = 64 << 20
"""Bytes of fetched-ahead reads a worker holds at once (NOTE [ Prefetch budget ])."""
FIRST_GUESS = PREFETCH_BYTES // 8
"""What an object of unknown size is guessed to weigh before any has been fetched: a fresh
worker's first window asks for eight such objects, and holds those that fit the budget."""
T = TypeVar("T")


class Deferred(Exception):
    """A read the prefetch budget had no room for, dropped before its body was read, to be asked for
    again in the next window (NOTE [ Prefetch budget ])."""

    def __init__(self, size: int | None) -> None:
        super().__init__(f"deferred: {size} bytes" if size is not None else "deferred unasked")
        self.size = size
        """The bytes the store stated the read holds; None where it was never asked for."""


class NotFetched(Exception):
    """A read the deadline passed before it finished: not the sample's fault, asked for again alone."""


class Requests:
    """Runs a worker's reads concurrently on an event loop of its own, within one deadline."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._loop = asyncio.new_event_loop()

    def run(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        """Each job's result or exception, in order; ``NotFetched`` for those the deadline stopped.
        StoreUnavailable if it stopped every one: a store that answers slowly still makes progress,
        one that does not answer makes none."""
        results = self._loop.run_until_complete(self._all(jobs))
        if jobs and all(isinstance(r, NotFetched) for r in results):
            raise StoreUnavailable(f"no read finished within {self.deadline:.0f} s")
        return results

    async def _all(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        gate = asyncio.Semaphore(MAX_CONCURRENT_READS)

        async def one(job: Callable[[], Awaitable[T]]) -> T:
            async with gate:
                return await job()

        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        done, pending = await asyncio.wait(tasks, timeout=self.deadline)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)  # let the cancelled ones finish unwinding on this loop
        return [_outcome(t) if t in done else NotFetched() for t in tasks]

    def close(self) -> None:
        self._loop.close()


def _outcome(task: asyncio.Task[T]) -> T | BaseException:
    exc = task.exception()
    return exc if exc is not None else task.result()


class Window:
    """The reads one fetch asks for at once, let hold their bytes in the task's order while they
    fit ``budget`` (NOTE [ Prefetch budget ]). Each read asks (``admit``) once it knows its size,
    or says it is over having asked nothing (``settle``); a read's answer waits for those before it."""

    def __init__(self, count: int, budget: int) -> None:
        self.budget = budget
        self.held = 0
        """Bytes the reads let in so far hold."""
        self.closed = False
        """Whether a read found no room: it and every read after it wait for the next window."""
        self._sizes: list[int | None] = [None] * count
        self._admitted = [False] * count
        self._decided = [asyncio.Event() for _ in range(count)]
        self._next = 0

    async def admit(self, position: int, size: int) -> None:
        """Let read ``position`` hold its ``size`` bytes, or raise Deferred (``Bucket.read``'s admit)."""
        self._sizes[position] = size
        self._decide()
        await self._decided[position].wait()
        if not self._admitted[position]:
            raise Deferred(size)

    def settle(self, position: int) -> None:
        """Read ``position`` is over: one that never asked (it failed first) holds nothing."""
        if self._sizes[position] is None:
            self._sizes[position] = 0
            self._decide()

    def _decide(self) -> None:
        """Answer the reads in order, up to the first whose size is not known yet."""
        while self._next < len(self._sizes):
            size = self._sizes[self._next]
            if not self.closed:
                if size is None:
                    return
                self.closed = self.held > 0 and self.held + size > self.budget
            if not self.closed:
                self.held += size or 0
                self._admitted[self._next] = True
            self._decided[self._next].set()
            self._next += 1


class ObjectFiles:
    """Objects under the folder URL ``root``. ``versions`` gives the (size, ETag) the index saw of
    the objects read by range; each read names that ETag, and only those objects are read from the
    cache folder."""

    def __init__(
        self,
        root: str,
        storage: StorageConfig,
        versions: Mapping[str, tuple[int, str]],
        max_bytes: int,
        heard: Heard | None = None,
    ) -> None:
        self.root = root
        self._heard = heard
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
        self._stated: dict[Want, int] = {}
        """The sizes the store stated of reads dropped for want of room, this task's."""
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
        self._stated.clear()
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
        """A read's bytes as far as known before asking: its range, else the object's size as
        indexed or as stated, else a guess (NOTE [ Prefetch budget ])."""
        name, _, size = want
        if size >= 0:
            return size
        if name in self.versions:
            return self.versions[name][0]
        if want in self._stated:
            return self._stated[want]
        total, count = self._unsized
        return max(total // count, 1) if count else FIRST_GUESS

    def held_bytes(self) -> int:
        """Bytes of fetched-ahead reads held now."""
        return sum(len(got) for got in self._got.values() if isinstance(got, bytes))

    def _fetch_now(self, todo: Sequence[Want]) -> None:
        """Add ``todo``'s results (data, or the sample's error) to what is held, as far as they fit
        the budget; those that did not go back to the front of what is ahead. A read the store
        failed or the deadline stopped is not held: it is asked for again alone when it is read.
        StoreUnavailable if none finished."""
        if not todo:
            return
        window = Window(len(todo), PREFETCH_BYTES)
        jobs = [functools.partial(self._fetch, w, window, k) for k, w in enumerate(todo)]
        deferred: list[Want] = []
        for want, result in zip(todo, self._requests.run(jobs), strict=True):
            if isinstance(result, Deferred):
                deferred.append(want)
                if result.size is not None:
                    self._stated[want] = result.size
                continue
            if want[2] < 0 and isinstance(result, bytes):
                self._unsized[0] += len(result)
                self._unsized[1] += 1
            got = self._outcome(want, result)
            if not isinstance(got, (NotFetched, StoreUnavailable)):
                self._got[want] = got
        self._ahead = {**dict.fromkeys(deferred), **self._ahead}

    def close(self) -> None:
        self._entries.close()
        self._requests.close()
        self._got.clear()
        self._ahead.clear()
        self._stated.clear()

    def _take(self, want: Want) -> bytes:
        """The bytes of ``want``: held since the last prefetch (kept until the next: a Parquet page
        serves several rows), else read alone now (a tar sample's metadata, a read that failed)."""
        got = self._got.get(want)
        if got is None and want in self._ahead:  # the task has reached the next window
            self._fetch_window(want)
            got = self._got.get(want)
        if got is None:
            alone = Window(1, PREFETCH_BYTES)
            (result,) = self._requests.run([functools.partial(self._fetch, want, alone, 0)])
            got = self._outcome(want, result)
            if isinstance(got, StoreUnavailable):
                raise got
            if self._fits(got):
                self._got[want] = got
        if isinstance(got, Exception):
            raise got
        return got

    def _fits(self, got: bytes | Exception) -> bool:
        """Whether a read made alone may be kept: only within the budget (NOTE [ Prefetch budget ])."""
        return not isinstance(got, bytes) or self.held_bytes() + len(got) <= PREFETCH_BYTES

    def _outcome(self, want: Want, result: bytes | BaseException) -> bytes | Exception:
        """A read's bytes, or what its failure is (``sample_error``)."""
        if not isinstance(result, BaseException):
            return result
        if isinstance(result, (DecodeError, StoreUnavailable, NotFetched)):
            return result
        if isinstance(result, Exception):
            return sample_error(result, join_url(self.root, want[0]))
        raise result  # KeyboardInterrupt and the like are not a sample's

    async def _fetch(self, want: Want, window: Window, position: int) -> bytes:
        """Read ``want``, the ``position``-th read of ``window``, if it lets it hold its bytes."""
        name, offset, size = want
        url = join_url(self.root, name)
        version = self.versions.get(name)
        etag = version[1] if version else ""
        try:
            if window.closed:  # a read before it found no room: not worth asking
                raise Deferred(None)
            admit = functools.partial(window.admit, position)
            return await self._bucket(url).read(split_url(url)[1], offset, size, etag, self.max_bytes, admit)
        finally:
            window.settle(position)

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
            bucket = Bucket(base, self.storage, self.storage.read_deadline, self._heard)
            self._buckets[base] = bucket
        return bucket
