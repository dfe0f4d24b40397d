"""A feed's decoded-sample cache: samples decoded once, kept in shared memory, reused every epoch.

The service creates one segment per feed with ``--cache-memory`` set (``CacheSegment``); every decode
worker maps it (``SampleCache``) and consults it before reading a file. What an entry holds depends on
whether the feed's output for a sample can change from epoch to epoch (``CacheKind``):

* ``final``: the sample's finished fields, for ``eval``, ``none`` and a pipeline declared
  deterministic. A hit is a copy into the slot.
* ``decoded``: the decoded image, full size, before any crop, for ``train`` and other pipelines. A hit
  skips reading and decoding; the crop, resize and flip (or the user's function) still run.

NOTE [ Sample cache ]
    * Admit until full, then keep: an entry is written once, by the first worker to decode the
      sample, and stays until the service stops. Nothing is evicted: under a new random permutation
      every epoch, eviction cannot beat keeping a fixed subset (``benchmarks.cache_policy`` measured
      it), and entries that never move need no reference counts, so a reader never waits.
    * The segment is ``--cache-memory`` bytes in all (header, table and entries), reserved with
      ``posix_fallocate`` at start like the slots (NOTE [ Shared-memory cleanup ]), so it cannot
      grow, and a small /dev/shm fails the start, not a later page fault.
    * The table holds one word per sample: 0 absent, ``WRITING`` while a worker copies the entry in,
      else the entry's offset. A writer reserves its bytes and marks the word ``WRITING`` under the
      feed's lock file, copies outside the lock, then publishes the offset under the lock again (the
      lock's system calls order the copy before the word on any CPU). Readers take no lock: they read
      the word, then the entry it points at, which nobody writes again. A worker killed mid-copy
      leaves ``WRITING`` behind: that sample stays a miss and its bytes stay unused; nothing
      half-written is ever visible.
    * Each entry repeats its sample's index; a reader that finds another index counts a miss.
    * The lock is only ever held for a few word updates; a worker that cannot take it within
      ``LOCK_TIMEOUT`` skips storing that sample rather than wait.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.shm import SAMPLE_CACHE, Segment
from protocol.layout import FieldSpec
from protocol.status import CacheStatus

log = logging.getLogger(__name__)

MAGIC = 0x64666361_63686531  # "dfcache1"
ENTRY_ALIGN = 64
ENTRY_HEADER = 32
"""Bytes before an entry's data: its sample index, data bytes, height and width (int64 each)."""
WRITING = -1
FULL_SHARE = 64
"""The cache is full once an entry does not fit and less than 1/64 of its entry space, or less than
its mean entry, is left."""
LOCK_TIMEOUT = 1.0
LOCK_NAME = "cache.lock"
U8 = npt.NDArray[np.uint8]

# Words of the header, int64 each.
_MAGIC, _SAMPLES, _TABLE, _ARENA, _SIZE, _NEXT, _ENTRIES, _FULL, _WORKERS, _SKIPPED = range(10)
_COUNTERS = 16
"""Word where the per-worker counters start: (hits, misses) per worker, each written by its worker only."""


class CacheKind(enum.Enum):
    FINAL = "final"
    DECODED = "decoded"

    @property
    def keeps(self) -> str:
        return "finished samples" if self is CacheKind.FINAL else "decoded images"


def cache_kind(augment: str, pipeline: str, deterministic: bool) -> CacheKind:
    """What a feed's cache keeps (module docstring)."""
    if pipeline:
        return CacheKind.FINAL if deterministic else CacheKind.DECODED
    return CacheKind.DECODED if augment == "train" else CacheKind.FINAL


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def header_bytes(workers: int) -> int:
    return _align(8 * (_COUNTERS + 2 * workers), 4096)


def overhead_bytes(samples: int, workers: int) -> int:
    """The bytes of a cache that hold no entry: its header and its table."""
    return header_bytes(workers) + _align(8 * samples, 4096)


def entry_bytes(data_bytes: int) -> int:
    """The bytes one entry of ``data_bytes`` takes in the cache."""
    return _align(ENTRY_HEADER + data_bytes, ENTRY_ALIGN)


class CacheTooSmall(ValueError):
    """``--cache-memory`` cannot even hold the cache's table."""


@dataclass(frozen=True)
class CacheSpec:
    """What a worker needs to map a feed's cache."""

    segment: str
    size: int
    kind: CacheKind
    lock: Path
    """The lock file writers take (``LOCK_NAME`` in the feed's runtime folder)."""


@dataclass(frozen=True)
class CacheStats:
    size: int
    used: int
    """Bytes of the segment taken: header, table and every entry reserved (published or not)."""
    entries: int
    hits: int
    misses: int
    full: bool
    skipped: int
    """Samples not stored because the lock could not be taken in time."""

    def status(self, kind: CacheKind) -> CacheStatus:
        return CacheStatus(
            kind=kind.value,
            bytes=self.size,
            bytes_used=self.used,
            entries=self.entries,
            hits=self.hits,
            misses=self.misses,
            full=self.full,
            lock_timeouts=self.skipped,
        )


class _Mapped:
    """Views of a mapped cache segment's header and table."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.header = np.ndarray((_COUNTERS,), np.int64, segment.buf, 0)
        samples, workers = int(self.header[_SAMPLES]), int(self.header[_WORKERS])
        self.counters = np.ndarray((max(workers, 1), 2), np.int64, segment.buf, 8 * _COUNTERS)
        self.table = np.ndarray((samples,), np.int64, segment.buf, int(self.header[_TABLE]))

    def stats(self) -> CacheStats:
        h = self.header
        totals = self.counters.sum(axis=0)
        return CacheStats(
            size=int(h[_SIZE]),
            used=int(h[_NEXT]),
            entries=int(h[_ENTRIES]),
            hits=int(totals[0]),
            misses=int(totals[1]),
            full=bool(h[_FULL]),
            skipped=int(h[_SKIPPED]),
        )


def _no_room_left(header: npt.NDArray[np.int64]) -> bool:
    left = int(header[_SIZE] - header[_NEXT])
    taken, entries = int(header[_NEXT] - header[_ARENA]), int(header[_ENTRIES])
    mean = taken // entries if entries else 0
    return left < (header[_SIZE] - header[_ARENA]) // FULL_SHARE or left < mean


class CacheSegment:
    """The service's side: creates the segment and its lock file, reads the counters, removes both."""

    def __init__(self, segment: Segment, kind: CacheKind, lock: Path) -> None:
        self._mapped = _Mapped(segment)
        self.kind = kind
        self.lock = lock

    @classmethod
    def create(
        cls, name: str, size: int, samples: int, workers: int, kind: CacheKind, lock: Path, group: str = ""
    ) -> CacheSegment:
        """CacheTooSmall if ``size`` cannot hold the table; SharedMemoryError if /dev/shm cannot."""
        start = overhead_bytes(samples, workers)
        if size < start:
            raise CacheTooSmall(
                f"cache_memory of {size} bytes is below the {start} its table for {samples} samples takes"
            )
        segment = Segment.create(name, size, group, purpose=SAMPLE_CACHE)
        try:
            header = np.ndarray((_COUNTERS,), np.int64, segment.buf, 0)
            # The segment is fresh from posix_fallocate: every byte, and so every table word, is 0.
            fields = [_SAMPLES, _TABLE, _ARENA, _SIZE, _NEXT, _WORKERS]
            header[fields] = (samples, header_bytes(workers), start, size, start, workers)
            header[_MAGIC] = MAGIC
            del header
            lock.touch(mode=0o600)
            return cls(segment, kind, lock)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    @property
    def spec(self) -> CacheSpec:
        segment = self._mapped.segment
        return CacheSpec(segment.name, segment.size, self.kind, self.lock)

    def stats(self) -> CacheStats:
        return self._mapped.stats()

    def close(self) -> None:
        segment = self._mapped.segment
        del self._mapped
        segment.close()
        segment.unlink()
        self.lock.unlink(missing_ok=True)


class SampleCache:
    """A decode worker's side: look samples up, store new ones (NOTE [ Sample cache ])."""

    def __init__(self, spec: CacheSpec, worker: int) -> None:
        segment = Segment.attach(spec.segment, spec.size)
        try:
            self._m = _Mapped(segment)
            if int(self._m.header[_MAGIC]) != MAGIC:
                raise ValueError(f"segment {spec.segment} is not a sample cache")
            self._lock_fd = os.open(spec.lock, os.O_RDWR | os.O_CLOEXEC)
        except BaseException:
            segment.close()
            raise
        self.kind = spec.kind
        self._buf = segment.buf
        self._end = spec.size
        self._slot = worker % len(self._m.counters)
        self._lock_lost = False

    @property
    def admitting(self) -> bool:
        """Whether a miss may still be stored: false once the cache is full, or once this worker
        could not take the lock in time (then something holds it, and waiting again would cost
        ``LOCK_TIMEOUT`` a sample)."""
        return not self._m.header[_FULL] and not self._lock_lost

    def find(self, index: int, data_bytes: int | None = None) -> tuple[int, int, int] | None:
        """(data offset, height, width) of sample ``index``'s entry, counted as a hit; or None, a miss.
        ``data_bytes``: what the entry must hold, if the caller knows (a finished sample's fields)."""
        at = int(self._m.table[index]) if 0 <= index < len(self._m.table) else 0
        if 0 < at <= self._end - ENTRY_HEADER:
            idx, data, height, width = np.ndarray((4,), np.int64, self._buf, at).tolist()
            expected = height * width * 3 if data_bytes is None else data_bytes
            if idx == index and data == expected and 0 <= data <= self._end - at - ENTRY_HEADER:
                self._m.counters[self._slot, 0] += 1
                return at + ENTRY_HEADER, height, width
        self._m.counters[self._slot, 1] += 1
        return None

    def holds(self, index: int) -> bool:
        """Whether sample ``index`` has an entry (not counted as a hit or a miss)."""
        return 0 <= index < len(self._m.table) and int(self._m.table[index]) > 0

    def image(self, index: int) -> U8 | None:
        """A decoded-kind entry as a read-only ``height x width x 3`` view, or None."""
        found = self.find(index)
        if found is None:
            return None
        at, height, width = found
        view: U8 = np.ndarray((height, width, 3), np.uint8, self._buf, at)
        view.flags.writeable = False
        return view

    def fields(self, index: int, specs: Sequence[FieldSpec]) -> list[npt.NDArray[Any]] | None:
        """A final-kind entry split into read-only arrays of the given fields, or None."""
        found = self.find(index, sum(f.row_bytes for f in specs))
        if found is None:
            return None
        at, out = found[0], []
        for f in specs:
            array: npt.NDArray[Any] = np.ndarray(f.shape, np.dtype(f.dtype), self._buf, at)
            array.flags.writeable = False
            out.append(array)
            at += f.row_bytes
        return out

    def store(self, index: int, parts: Sequence[npt.NDArray[Any]], height: int = 0, width: int = 0) -> bool:
        """Keep ``parts`` (concatenated) as sample ``index``'s entry, unless it is there already, being
        written, or does not fit. Whether it was stored."""
        data = sum(p.nbytes for p in parts)
        at = self._reserve(index, entry_bytes(data))
        if at is None:
            return False
        np.ndarray((4,), np.int64, self._buf, at)[:] = (index, data, height, width)
        pos = at + ENTRY_HEADER
        for part in parts:
            np.copyto(np.ndarray(part.shape, part.dtype, self._buf, pos), part)
            pos += part.nbytes
        return self._publish(index, at)

    def _reserve(self, index: int, need: int) -> int | None:
        if not 0 <= index < len(self._m.table) or self._m.table[index] != 0:
            return None  # checked without the lock first: the common case during later epochs
        if not self._lock():
            return None
        try:
            header = self._m.header
            at = int(header[_NEXT])
            if self._m.table[index] != 0:
                return None
            if at + need > header[_SIZE]:
                # One image too large for what is left must not close a cache with room for others.
                if _no_room_left(header):
                    header[_FULL] = 1
                return None
            header[_NEXT] = at + need
            self._m.table[index] = WRITING
            return at
        finally:
            self._unlock()

    def _publish(self, index: int, at: int) -> bool:
        if not self._lock():
            return False  # the word stays WRITING: a miss for good, never a half-written entry
        try:
            self._m.table[index] = at
            self._m.header[_ENTRIES] += 1
            return True
        finally:
            self._unlock()

    def _lock(self) -> bool:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                    raise
            if time.monotonic() >= deadline:
                self._m.header[_SKIPPED] += 1  # racy, and only a statistic
                self._lock_lost = True
                log.warning(
                    "sample cache: its lock was held for over %.1f s (by a process the service did not "
                    "start?); this worker stores nothing more in it",
                    LOCK_TIMEOUT,
                )
                return False
            time.sleep(0.0002)

    def _unlock(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def stats(self) -> CacheStats:
        return self._m.stats()

    def close(self) -> None:
        os.close(self._lock_fd)
        segment = self._m.segment
        del self._m, self._buf  # the views and the reference the mapping would otherwise outlive
        segment.close()
