"""The decoded-sample cache's shared-memory structure (NOTE [ Sample cache ]): entries round-trip, the
size is never exceeded, concurrent writers in real processes never tear an entry, a writer killed
mid-copy leaves a miss and nothing half-written, and a held lock costs a skipped store, not a hang.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loader_service.decode import cache as cache_module
from loader_service.decode.cache import (
    WRITING,
    CacheKind,
    CacheSegment,
    CacheSpec,
    CacheTooSmall,
    SampleCache,
    cache_kind,
    entry_bytes,
    overhead_bytes,
)
from loader_service.shm import new_segment_name
from protocol.layout import FieldSpec

SAMPLES = 50
WORKERS = 4

MakeCache = Callable[..., CacheSegment]


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[MakeCache]:
    made: list[CacheSegment] = []

    def make(
        size: int = 8 << 20, samples: int = SAMPLES, kind: CacheKind = CacheKind.DECODED
    ) -> CacheSegment:
        lock = tmp_path / f"cache{len(made)}.lock"
        seg = CacheSegment.create(new_segment_name("cache-test"), size, samples, WORKERS, kind, lock)
        made.append(seg)
        return seg

    yield make
    for seg in made:
        seg.close()


Attach = Callable[[CacheSegment, int], SampleCache]


@pytest.fixture
def attach() -> Iterator[Attach]:
    """``attach(cache, worker)``: a worker's view of the cache, closed when the test ends."""
    opened: list[SampleCache] = []

    def open_one(seg: CacheSegment, worker: int) -> SampleCache:
        opened.append(SampleCache(seg.spec, worker))
        return opened[-1]

    yield open_one
    for cache in reversed(opened):
        cache.close()


def image(idx: int, height: int = 20, width: int = 30) -> np.ndarray:
    """A picture no other index gives."""
    rng = np.random.default_rng(idx)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_what_each_feed_keeps() -> None:
    assert cache_kind("train", "", False) is CacheKind.DECODED
    assert cache_kind("eval", "", False) is CacheKind.FINAL
    assert cache_kind("none", "", False) is CacheKind.FINAL
    assert cache_kind("train", "aug.py:f", False) is CacheKind.DECODED
    assert cache_kind("train", "aug.py:f", True) is CacheKind.FINAL


def test_an_image_comes_back_as_stored_and_counts_hits_and_misses(
    make_cache: MakeCache, attach: Attach
) -> None:
    seg = make_cache()
    cache = attach(seg, 1)
    assert cache.image(3) is None
    stored = image(3, 17, 23)
    assert cache.store(3, [stored], 17, 23)
    got = cache.image(3)
    assert got is not None and np.array_equal(got, stored)
    assert not got.flags.writeable  # an entry is never written again
    assert not cache.store(3, [image(4)], 20, 30)  # the first copy stays
    stats = seg.stats()
    assert (stats.entries, stats.hits, stats.misses) == (1, 1, 1)
    assert stats.used == overhead_bytes(SAMPLES, WORKERS) + entry_bytes(stored.nbytes)


def test_finished_fields_come_back_split_by_dtype_and_shape(make_cache: MakeCache, attach: Attach) -> None:
    seg = make_cache(kind=CacheKind.FINAL)
    cache = attach(seg, 0)
    pixels = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    label = np.asarray(7, np.int64)
    assert cache.store(9, [pixels, label])
    got = cache.fields(9, [FieldSpec("x", "float16", (2, 3, 4)), FieldSpec("y", "int64", ())])
    assert got is not None
    assert np.array_equal(got[0], pixels) and got[1] == 7
    assert cache.fields(8, [FieldSpec("y", "int64", ())]) is None


def test_an_entry_naming_another_sample_is_a_miss(make_cache: MakeCache, attach: Attach) -> None:
    seg = make_cache()
    cache = attach(seg, 0)
    assert cache.store(5, [image(5)], 20, 30)
    cache._m.table[6] = cache._m.table[5]  # damage: sample 6 pointing at 5's entry
    assert cache.image(6) is None
    assert seg.stats().misses == 1


def test_an_entry_whose_sizes_disagree_or_run_past_the_end_is_a_miss(
    make_cache: MakeCache, attach: Attach
) -> None:
    seg = make_cache(kind=CacheKind.FINAL)
    cache = attach(seg, 0)
    assert cache.store(5, [np.zeros(10, np.int64)])
    assert cache.fields(5, [FieldSpec("x", "int64", (11,))]) is None  # 88 bytes asked of an 80-byte entry
    assert cache.fields(5, [FieldSpec("x", "int64", (10,))]) is not None
    cache._m.table[5] = seg.spec.size - 8  # damage: an entry that would run off the segment
    assert cache.fields(5, [FieldSpec("x", "int64", (10,))]) is None


def test_the_cache_fills_to_its_size_and_then_admits_nothing(make_cache: MakeCache, attach: Attach) -> None:
    one = entry_bytes(image(0).nbytes)
    size = overhead_bytes(SAMPLES, WORKERS) + 5 * one + one // 2
    seg = make_cache(size=size)
    cache = attach(seg, 0)
    stored = [i for i in range(SAMPLES) if cache.admitting and cache.store(i, [image(i)], 20, 30)]
    assert stored == [0, 1, 2, 3, 4]
    assert not cache.admitting
    stats = seg.stats()
    assert stats.full and stats.entries == 5 and stats.used <= size
    assert all(np.array_equal(cache.image(i), image(i)) for i in stored)  # type: ignore[arg-type]


def test_a_cache_too_small_for_its_table_is_refused(make_cache: MakeCache) -> None:
    with pytest.raises(CacheTooSmall, match="its table for 1000000 samples"):
        make_cache(size=1 << 20, samples=1_000_000)


def _store_all(spec: CacheSpec, worker: int, indices: list[int], go: Any) -> None:
    cache = SampleCache(spec, worker)
    assert go.wait(60)
    for i in indices:
        cache.store(i, [image(i, 20 + i % 7, 30)], 20 + i % 7, 30)
    cache.close()


def _read_while_written(spec: CacheSpec, go: Any) -> None:
    """Read every sample again and again while the writers write, until all are there: whatever is
    found must be whole."""
    cache = SampleCache(spec, WORKERS - 1)
    deadline = time.monotonic() + 60
    seen: set[int] = set()
    go.set()  # the writers start once the reader is reading
    while len(seen) < 400 and time.monotonic() < deadline:
        for i in range(400):
            got = cache.image(i)
            if got is not None:
                assert np.array_equal(got, image(i, 20 + i % 7, 30)), f"sample {i} torn"
                seen.add(i)
    cache.close()
    assert len(seen) == 400


def test_writers_and_a_reader_in_several_processes_see_only_whole_entries(make_cache: MakeCache) -> None:
    seg = make_cache(samples=400)
    order = list(range(400))
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    # Every writer tries every sample, in its own order: each sample is raced for by all three.
    writers = [
        ctx.Process(target=_store_all, args=(seg.spec, w, order[w * 100 :] + order[: w * 100], go))
        for w in range(WORKERS - 1)
    ]
    reader = ctx.Process(target=_read_while_written, args=(seg.spec, go))
    for p in [*writers, reader]:
        p.start()
    for p in [*writers, reader]:
        p.join(120)
        assert p.exitcode == 0
    stats = seg.stats()
    assert stats.entries == 400  # one winner a sample
    assert stats.used <= seg.spec.size
    assert stats.hits > 0  # the reader found entries while they were being written


def _die_while_writing(spec: CacheSpec, index: int) -> None:
    cache = SampleCache(spec, 0)
    at = cache._reserve(index, entry_bytes(image(index).nbytes))
    assert at is not None
    cache._buf[at : at + 40] = b"x" * 40  # half an entry
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_mid_copy_leaves_a_miss_not_a_half_entry(
    make_cache: MakeCache, attach: Attach
) -> None:
    seg = make_cache()
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_die_while_writing, args=(seg.spec, 11))
    writer.start()
    writer.join(60)
    assert writer.exitcode == -signal.SIGKILL
    cache = attach(seg, 0)
    assert cache._m.table[11] == WRITING
    assert cache.image(11) is None
    assert not cache.store(11, [image(11)], 20, 30)  # never overwritten: it stays a miss
    assert cache.store(12, [image(12)], 20, 30)  # and the lock the dead writer held is free
    assert seg.stats().entries == 1


def test_a_lock_held_by_a_stopped_process_costs_one_wait_then_stores_stop(
    make_cache: MakeCache, attach: Attach, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = make_cache()
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT", 0.2)
    holder = os.open(seg.lock, os.O_RDWR)
    cache, other = attach(seg, 0), attach(seg, 1)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert not cache.store(1, [image(1)], 20, 30)
        assert cache._m.table[1] == 0  # nothing reserved
        assert seg.stats().skipped == 1 and seg.stats().status(seg.kind).lock_timeouts == 1
        assert not cache.admitting  # it does not wait a second time, sample after sample
        assert other.admitting  # another worker still tries
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert other.store(2, [image(2)], 20, 30)
        assert cache.image(2) is not None  # and the one that gave up still reads
    finally:
        os.close(holder)


def test_one_image_too_large_for_the_space_left_does_not_close_the_cache(
    make_cache: MakeCache, attach: Attach
) -> None:
    one = entry_bytes(image(0).nbytes)
    seg = make_cache(size=overhead_bytes(SAMPLES, WORKERS) + 4 * one)
    cache = attach(seg, 0)
    huge = image(1, 60, 90)  # nine ordinary entries' worth
    assert not cache.store(1, [huge], 60, 90)
    assert cache.admitting  # skipped, not full
    assert [i for i in range(2, 8) if cache.store(i, [image(i)], 20, 30)] == [2, 3, 4, 5]
    assert not cache.admitting and seg.stats().full  # under 1/64 left once an entry did not fit


def test_a_failed_creation_leaves_no_segment(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    lock = tmp_path / "no-such-folder" / "cache.lock"  # touching it fails after the segment exists
    with pytest.raises(FileNotFoundError):
        CacheSegment.create(new_segment_name("cache-test"), 1 << 20, 10, 1, CacheKind.FINAL, lock)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(f"dataferry-{os.getpid()}-")}


def test_closing_removes_the_segment_and_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "cache.lock"
    seg = CacheSegment.create(new_segment_name("cache-test"), 1 << 20, 10, 1, CacheKind.FINAL, lock)
    name = seg.spec.segment
    assert Path("/dev/shm", name).stat().st_size == 1 << 20  # all of it reserved at start
    seg.close()
    assert not Path("/dev/shm", name).exists()
    assert not lock.exists()
