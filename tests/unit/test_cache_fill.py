"""Decode workers with a sample cache (NOTE [ Sample cache ]): the same pixels as without one, bit for
bit, in the epoch that fills it and in the epochs that hit it, for every built-in transform and for
pipelines of both kinds. Real files, real shared memory, the worker's own ``fill_slot``.

What the train transform's cached path reproduces: a full decode's pixels (``--decoder opencv``),
not the region decoder's DCT-scaled ones; the tests show both that it equals the former exactly and
that the latter really differ on these photos, so the comparison means something.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from loader_service.dataset.index import build_index
from loader_service.decode.cache import CacheKind, CacheSegment, cache_kind, overhead_bytes
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import uses_roi
from loader_service.decode.worker import OpenFeed, WorkerFeed, fill_slot, open_feed, slot_views
from loader_service.shm import Segment, new_segment_name
from protocol.layout import FieldSpec, SlotLayout
from protocol.workers import Task

pytestmark = pytest.mark.usefixtures("restore_process_state")

SEED = 3
SIZE = 32
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pipelines"
INDICES = [5, 0, 44, 89, 12, 61, 30, 77]
IMAGES = SlotLayout.images(8, SIZE)
NUMPY_LAYOUT = SlotLayout(8, (FieldSpec("image", "float16", (3, 224, 224)), FieldSpec("label", "int64", ())))

OpenCached = Callable[..., tuple[OpenFeed, CacheSegment | None]]


@pytest.fixture
def open_cached(tmp_path: Path, photos: Path) -> Iterator[OpenCached]:
    """``open_cached(layout, augment, roi, pipeline, cache_bytes, deterministic)``: a worker's feed over
    ``photos``, with a cache of ``cache_bytes`` (0: none)."""
    cleanup: list[Callable[[], None]] = []
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    build_index(photos).save(index_dir)

    def make(
        layout: SlotLayout = IMAGES,
        augment: str = "train",
        roi: bool = False,
        pipeline: str = "",
        cache_bytes: int = 1 << 30,
        deterministic: bool = False,
    ) -> tuple[OpenFeed, CacheSegment | None]:
        pool = Segment.create(new_segment_name("cache-fill"), layout.mapped_bytes(2))
        cleanup.extend([pool.unlink, pool.close])
        filter_ = INTERPOLATIONS[0]
        spec = WorkerFeed(pool.name, 2, layout, index_dir, SEED, augment, filter_, pipeline, 1 << 24)
        cache = None
        if cache_bytes:
            kind = cache_kind(augment, pipeline, deterministic)
            lock = tmp_path / f"cache{len(cleanup)}.lock"
            cache = CacheSegment.create(new_segment_name("cache-fill"), cache_bytes, 90, 1, kind, lock)
            cleanup.append(cache.close)
            spec = replace(spec, cache=cache.spec)
        feed = open_feed(spec, roi)
        cleanup.append(feed.close)
        return feed, cache

    yield make
    for step in reversed(cleanup):
        step()


def epoch_rows(feed: OpenFeed, epoch: int, indices: list[int] = INDICES) -> dict[str, np.ndarray]:
    """Fill one slot with ``indices`` in ``epoch``; a copy of its fields."""
    done = fill_slot(0, feed, Task(1, 0, 0, epoch, np.asarray(indices, "<i8").tobytes()))
    assert (done.count, done.bad) == (len(indices), ())
    views = slot_views(feed.segment, feed.spec.layout, 0, feed.spec.slots)
    return {name: array.copy() for name, array in views.fields.items()}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("augment", "roi"), [("eval", False), ("eval", True), ("none", False), ("none", True)]
)
def test_a_finished_sample_cache_gives_the_same_pixels_every_epoch(
    open_cached: OpenCached, augment: str, roi: bool
) -> None:
    if roi and not uses_roi("auto"):
        pytest.skip("the region decoder is not built here")
    cached, cache = open_cached(augment=augment, roi=roi)
    plain, _ = open_cached(augment=augment, roi=roi, cache_bytes=0)
    assert cache is not None and cache.kind is CacheKind.FINAL
    for epoch in (1, 2, 3):
        assert same(epoch_rows(cached, epoch), epoch_rows(plain, epoch)), epoch
    stats = cache.stats()
    assert (stats.entries, stats.misses, stats.hits) == (len(INDICES), len(INDICES), 2 * len(INDICES))


@pytest.mark.parametrize("roi", [False, True])
def test_a_train_cache_gives_a_full_decodes_pixels_in_every_epoch(open_cached: OpenCached, roi: bool) -> None:
    if roi and not uses_roi("auto"):
        pytest.skip("the region decoder is not built here")
    cached, cache = open_cached(augment="train", roi=roi)
    full_decode, _ = open_cached(augment="train", roi=False, cache_bytes=0)
    assert cache is not None and cache.kind is CacheKind.DECODED
    for epoch in (1, 2, 3):
        got = epoch_rows(cached, epoch)
        assert same(got, epoch_rows(full_decode, epoch)), epoch
    stats = cache.stats()
    assert (stats.entries, stats.hits) == (len(INDICES), 2 * len(INDICES))


def test_the_region_decoder_scales_these_crops_so_the_train_comparison_means_something(
    open_cached: OpenCached,
) -> None:
    if not uses_roi("auto"):
        pytest.skip("the region decoder is not built here")
    scaled, _ = open_cached(augment="train", roi=True, cache_bytes=0)
    full_decode, _ = open_cached(augment="train", roi=False, cache_bytes=0)
    assert not same(epoch_rows(scaled, 2), epoch_rows(full_decode, 2))


def test_a_full_train_cache_still_gives_a_full_decodes_pixels_for_what_it_misses(
    open_cached: OpenCached,
) -> None:
    # Room for about three of the photos: the rest are misses after it is full, region-decoded
    # without DCT scaling where the decoder is built.
    room = overhead_bytes(90, 1) + 3 * 640 * 480 * 3
    cached, cache = open_cached(augment="train", roi=uses_roi("auto"), cache_bytes=room)
    full_decode, _ = open_cached(augment="train", roi=False, cache_bytes=0)
    for epoch in (1, 2):
        assert same(epoch_rows(cached, epoch), epoch_rows(full_decode, epoch)), epoch
    assert cache is not None
    stats = cache.stats()
    assert stats.full and 0 < stats.entries < len(INDICES) and stats.used <= room
    assert stats.hits == stats.entries  # epoch 2 hit exactly what epoch 1 kept


def test_a_pipeline_reads_its_image_from_the_cache_with_the_same_output(open_cached: OpenCached) -> None:
    spec = f"{EXAMPLES / 'numpy_aug.py'}:train"
    cached, cache = open_cached(NUMPY_LAYOUT, pipeline=spec)
    plain, _ = open_cached(NUMPY_LAYOUT, pipeline=spec, cache_bytes=0)
    assert cache is not None and cache.kind is CacheKind.DECODED
    outputs = [epoch_rows(cached, epoch) for epoch in (1, 2)]
    assert not same(outputs[0], outputs[1])  # a random pipeline: the cache kept images, not outputs
    for epoch, got in zip((1, 2), outputs, strict=True):
        assert same(got, epoch_rows(plain, epoch)), epoch
    assert cache.stats().hits == len(INDICES)


def test_a_deterministic_pipeline_is_kept_finished(open_cached: OpenCached) -> None:
    spec = f"{EXAMPLES / 'numpy_aug.py'}:evaluate"
    cached, cache = open_cached(NUMPY_LAYOUT, pipeline=spec, deterministic=True)
    plain, _ = open_cached(NUMPY_LAYOUT, pipeline=spec, cache_bytes=0)
    assert cache is not None and cache.kind is CacheKind.FINAL
    for epoch in (1, 2):
        assert same(epoch_rows(cached, epoch), epoch_rows(plain, epoch)), epoch
    stats = cache.stats()
    assert (stats.entries, stats.hits) == (len(INDICES), len(INDICES))


def test_a_bad_sample_is_never_kept(tmp_path: Path, open_cached: OpenCached, photos: Path) -> None:
    cached, cache = open_cached(augment="eval")
    victim = cached.sources.path(INDICES[0])
    original = victim.read_bytes()
    victim.write_bytes(b"not an image")
    try:
        done = fill_slot(0, cached, Task(1, 0, 0, 1, np.asarray(INDICES, "<i8").tobytes()))
        assert [i for i, _ in done.bad] == [INDICES[0]]
        again = fill_slot(0, cached, Task(1, 0, 0, 2, np.asarray(INDICES, "<i8").tobytes()))
        assert [i for i, _ in again.bad] == [INDICES[0]]  # still bad: nothing was kept for it
    finally:
        victim.write_bytes(original)
    assert cache is not None and cache.stats().entries == len(INDICES) - 1
