"""A decode worker process: takes tasks from the service, fills slots with samples straight in place.

Each worker is spawned (never forked: the service holds sockets and threads) and gets one frozen
``WorkerConfig``. It maps the dataset index and the slot segment read/write, imports the feeds' user
pipelines (``decode.pipeline``), and answers every task with ``done``: the rows written and the
samples that were bad (an undecodable file, a pipeline that raised), which are data, not crashes.
It exits on ``stop``, and by itself when its parent is gone (checked between polls).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt
import zmq

from loader_service.dataset.sampler import sample_rng
from loader_service.dataset.sources import FeedSources
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeerrors import StoreUnavailable
from loader_service.decode.cache import CacheKind, SampleCache
from loader_service.decode.contract import (
    FAULT_ENV,
    HANG_ON,
    WORKER_BOOT_ERROR,
    SlotViews,
    WorkerConfig,
    WorkerFeed,
    slot_views,
)
from loader_service.decode.pipeline import Pipeline, load_pipeline, run_into
from loader_service.decode.progress import PREFETCHING, ProgressBoard
from loader_service.decode.reading import FeedReader
from loader_service.decode.sample import Sample
from loader_service.decode.transforms import Recipe, load_bytes_into, plan_row, transform_into
from loader_service.logs import configure_logging
from loader_service.shm import Segment, process_start
from protocol.codec import decode, encode
from protocol.encoded import encoded_rows
from protocol.layout import SlotLayout, describe_fields, image_fields
from protocol.messages import MAX_BAD_REPORTS
from protocol.pixels import DecodeError
from protocol.pixels.geometry import prepare
from protocol.pixels.render import decode_bytes, render
from protocol.workers import StopWorker, Task, TaskDone, WorkerReady

log = logging.getLogger(__name__)
POLL_MS = 500


@dataclass
class OpenFeed:
    spec: WorkerFeed
    sources: FeedSources
    reader: FeedReader
    segment: Segment
    pipeline: Pipeline | None
    """The user's function, or None for the built-in transforms."""
    recipe: Recipe
    """The built-in transform, filter and decoder; unused with a pipeline."""
    cache: SampleCache | None = None
    hidden_reported: set[str] = field(default_factory=set)
    """Metadata names already reported as hidden by a reserved key (logged once each)."""

    def close(self) -> None:
        self.reader.close()
        self.segment.close()
        if self.cache is not None:
            self.cache.close()

    def final_cache(self) -> SampleCache | None:
        """The cache, if it keeps finished samples."""
        return self.cache if self.cache is not None and self.cache.kind is CacheKind.FINAL else None

    def decoded_cache(self) -> SampleCache | None:
        """The cache, if it keeps decoded images."""
        return self.cache if self.cache is not None and self.cache.kind is CacheKind.DECODED else None


Progress = Callable[[int], None]
"""Called with the number of the task's samples finished so far (NOTE [ Per-sample progress ])."""


class EncodedRoom:
    """Where a task puts the bytes of the rows it leaves encoded: the part of the slot's byte area
    that belongs to its rows, filled from the start (NOTE [ Encoded rows ])."""

    def __init__(self, views: SlotViews, row: int, rows: int, per_row: int) -> None:
        assert views.table is not None and views.encoded is not None
        self.table, self.area = views.table, views.encoded
        self.next, self.end = row * per_row, (row + rows) * per_row
        self.rows = 0

    def put(self, data: bytes) -> int | None:
        """The offset ``data`` now has in the area, or None where the task's room is used up."""
        if self.end - self.next < len(data):
            return None
        offset = self.next
        self.area[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        self.next += len(data)
        self.rows += 1
        return offset


def fill_slot(worker: int, feed: OpenFeed, task: Task, progress: Progress | None = None) -> TaskDone:
    """Fill ``task``'s samples into consecutive rows from ``task.row`` on, skipping (and reporting)
    bad samples; ``count`` is the rows written, ``encoded`` those of them left encoded for the
    trainer (``task.encode``'s share, where a sample can be: NOTE [ Encoded rows ])."""
    layout = feed.spec.layout
    views = slot_views(feed.segment, layout, task.slot, feed.spec.slots)
    row = task.row
    bad: list[tuple[int, str]] = []
    indices = np.frombuffer(task.indices, dtype="<i8").tolist()
    hang = _hang_text()
    room = EncodedRoom(views, row, len(indices), layout.encoded) if layout.encoded else None
    wanted = encoded_rows(task.encode if room is not None else 0, len(indices))
    try:
        _prefetch(feed, indices)
        if progress is not None:
            progress(0)  # from here a death is its first sample's (NOTE [ Waiting on the store ])
        for done, idx in enumerate(indices, start=1):
            if hang:
                _injected_hang(feed, idx, hang)
            if room is not None:
                room.table[row] = 0  # a row the service decodes; an encoded one says so below
            reason = fill_row(feed, views, row, idx, task.epoch, room if wanted[done - 1] else None)
            if reason is not None:
                bad.append((idx, reason))
            else:
                views.indices[row] = idx
                row += 1
            if progress is not None:
                progress(done)
    except StoreUnavailable as exc:  # NOTE [ Object store reads ]: the task again later, whole
        return TaskDone(task.task, worker, 0, (), retry=str(exc)[:300])
    encoded = 0 if room is None else room.rows
    return TaskDone(task.task, worker, row - task.row, tuple(bad[:MAX_BAD_REPORTS]), encoded=encoded)


def _prefetch(feed: OpenFeed, indices: list[int]) -> None:
    """Ask the store for what the task will read, but what the sample cache holds."""
    cache = feed.cache
    feed.reader.prefetch(indices if cache is None else [i for i in indices if not cache.holds(i)])


def fill_row(
    feed: OpenFeed, views: SlotViews, row: int, idx: int, epoch: int, room: EncodedRoom | None = None
) -> str | None:
    """Write sample ``idx`` into ``row`` of every field: None, or why the sample is bad. With
    ``room``, the row may be left encoded for the trainer instead (NOTE [ Encoded rows ])."""
    if not 0 <= idx < len(feed.sources):
        return "index outside dataset"
    final = feed.final_cache()
    if final is not None and _copy_cached(final, feed.spec.layout, views, row, idx):
        return None
    if feed.pipeline is not None:
        reason = _pipeline_row(feed, feed.pipeline, views, row, idx, epoch)
    else:
        reason = _builtin_row(feed, views, row, idx, epoch, room)
    if reason is None and final is not None and final.admitting:
        final.store(idx, [views.fields[f.name][row, ...] for f in feed.spec.layout.fields])
    return reason


def _copy_cached(cache: SampleCache, layout: SlotLayout, views: SlotViews, row: int, idx: int) -> bool:
    """Fill the row from a finished sample the cache keeps; whether it had one."""
    found = cache.fields(idx, layout.fields)
    if found is None:
        return False
    for f, array in zip(layout.fields, found, strict=True):
        views.fields[f.name][row, ...] = array
    return True


def _builtin_row(
    feed: OpenFeed, views: SlotViews, row: int, idx: int, epoch: int, room: EncodedRoom | None
) -> str | None:
    try:
        rng = sample_rng(feed.spec.seed, epoch, idx)
        out = views.fields["image"][row]
        decoded = feed.decoded_cache()
        if decoded is not None:
            _through_decoded_cache(feed, decoded, idx, out, rng)
        elif room is not None and (feed.cache is None or not (feed.cache.admitting or feed.cache.holds(idx))):
            _maybe_encoded(feed.reader.image_bytes(idx), out, feed.recipe, rng, room, row)
        else:
            load_bytes_into(feed.reader.image_bytes(idx), out, feed.recipe, rng)
    except DecodeError as exc:
        return str(exc)
    except StoreUnavailable:
        raise  # not the sample's fault: its task is done again (fill_slot)
    except Exception as exc:  # an OpenCV failure on one file must not take the worker down
        return f"{type(exc).__name__}: {exc}"[:200]
    views.fields["label"][row] = feed.sources.labels[idx]
    return None


def _maybe_encoded(
    data: bytes,
    out: npt.NDArray[np.uint8],
    recipe: Recipe,
    rng: np.random.Generator,
    room: EncodedRoom,
    row: int,
) -> None:
    """Leave the row encoded where its file can be and the task's room holds it; else decode it
    here, with the draws already made (NOTE [ Encoded rows ])."""
    planned = plan_row(data, out.shape[1], recipe, rng)
    if planned is None:
        transform_into(decode_bytes(data), out, recipe, rng)
        return
    offset = room.put(data)
    if offset is None:
        render(data, planned, out, check=False)
        return
    room.table[row] = replace(planned, offset=offset).columns()


def _through_decoded_cache(
    feed: OpenFeed, cache: SampleCache, idx: int, out: npt.NDArray[np.uint8], rng: np.random.Generator
) -> None:
    """The train transform on the cached image; on a miss, on a full decode that the cache keeps, or,
    once the cache is full, on a region decode without DCT scaling: all three give the same pixels
    (NOTE [ Sample cache ], ``Recipe.dct_scaling``)."""
    image = cache.image(idx)
    if image is None and cache.admitting:
        image = decode_bytes(feed.reader.image_bytes(idx))
        cache.store(idx, [image], image.shape[0], image.shape[1])
    if image is None:
        load_bytes_into(feed.reader.image_bytes(idx), out, feed.recipe, rng)
    else:
        transform_into(image, out, feed.recipe, rng)


def _pipeline_row(
    feed: OpenFeed, pipeline: Pipeline, views: SlotViews, row: int, idx: int, epoch: int
) -> str | None:
    sample = Sample(feed.reader, feed.sources, idx, epoch, feed.decoded_cache())
    # [row, ...]: a view even for a scalar field, where [row] would be a copy (a numpy scalar).
    rows = {name: array[row, ...] for name, array in views.fields.items()}
    reason = run_into(pipeline, sample, feed.spec.seed, feed.spec.layout.fields, rows)
    for name in set(sample.hidden) - feed.hidden_reported:
        feed.hidden_reported.add(name)
        log.warning(
            "%s: metadata %r is hidden by the sample's own %r; rename it in the source to reach it",
            sample["path"],
            name,
            name,
        )
    return reason


def run_worker(cfg: WorkerConfig) -> None:
    """Entry point of a spawned decode worker."""
    configure_logging(cfg.log_level, f"worker-{cfg.worker}")
    # Ctrl-C reaches the whole process group; the service decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cv2.setNumThreads(1)  # and for a pipeline, torch and BLAS too (pipeline.single_threaded)
    board = ProgressBoard(Path(cfg.progress), cfg.workers) if cfg.progress else None
    heard = functools.partial(board.answered, cfg.worker) if board is not None else None
    try:
        feeds = _open_feeds(cfg, heard)
    except Exception as exc:
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        sys.exit(WORKER_BOOT_ERROR)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(cfg.backend)
        sock.send(encode(WorkerReady(cfg.worker, os.getpid())))
        _serve_tasks(cfg, feeds, sock, board)
    finally:
        sock.close(linger=0)
        ctx.term()
        for feed in feeds:
            feed.close()
        if board is not None:
            board.close()


def _open_feeds(cfg: WorkerConfig, heard: Heard | None) -> list[OpenFeed]:
    if os.environ.get(FAULT_ENV) == "worker-boot":
        raise RuntimeError(f"fault injected by {FAULT_ENV}")
    opened: list[OpenFeed] = []
    try:
        for f in cfg.feeds:
            opened.append(open_feed(f, cfg.roi, cfg.worker, heard))
    except BaseException:
        for feed in opened:
            feed.close()
        raise
    return opened


def open_feed(spec: WorkerFeed, roi: bool = False, worker: int = 0, heard: Heard | None = None) -> OpenFeed:
    """Map the feed's index, slot pool and cache, and import its pipeline (PipelineError if that
    fails); ``heard`` is told of each answer of the data's store (the worker's progress page)."""
    pipeline = load_pipeline(spec.pipeline) if spec.pipeline else None
    # A cache of decoded images gives full-decode pixels, so every other sample must too.
    decoded = spec.cache is not None and spec.cache.kind is CacheKind.DECODED
    recipe = Recipe(spec.augment, spec.interpolation, roi, dct_scaling=not decoded)
    if pipeline is None:
        check_builtin_layout(spec.layout)
        prepare(spec.interpolation)
    index = FeedSources.load(spec.index_dir)
    segment = Segment.attach(spec.segment, spec.layout.segment_bytes(spec.slots))
    try:
        cache = None if spec.cache is None else SampleCache(spec.cache, worker)
    except BaseException:
        segment.close()
        raise
    reader = FeedReader(index, spec.max_file_bytes, spec.storage, heard)
    return OpenFeed(spec, index, reader, segment, pipeline, recipe, cache)


def check_builtin_layout(layout: SlotLayout) -> None:
    """The built-in transforms write a 3 x S x S uint8 ``image`` and an int64 ``label``, nothing else."""
    image = layout.fields[0]
    expected = image_fields(image.shape[-1]) if image.shape else ()
    if layout.fields != expected:
        found = describe_fields(layout.fields)
        raise ValueError(f"the built-in transforms fill image uint8[3, S, S] and label int64[], not {found}")


def _serve_tasks(
    cfg: WorkerConfig, feeds: list[OpenFeed], sock: zmq.Socket[bytes], board: ProgressBoard | None
) -> None:
    progress: Progress | None = None
    if board is not None:
        progress = functools.partial(board.finished, cfg.worker)
    while True:
        if not sock.poll(POLL_MS):
            if process_start(cfg.parent_pid) != cfg.parent_start:
                log.warning("service process %d is gone; exiting", cfg.parent_pid)
                return
            continue
        msg = decode(sock.recv(), (Task, StopWorker))
        if not isinstance(msg, Task):
            return  # stop
        if not 0 <= msg.feed < len(feeds):
            log.error("task %d names feed %d of %d; ignored", msg.task, msg.feed, len(feeds))
            continue
        if cfg.write_nothing:
            sock.send(encode(indices_only(cfg.worker, feeds[msg.feed], msg)))
            continue
        if board is not None:
            board.start(cfg.worker, msg.task, PREFETCHING)
        sock.send(encode(fill_slot(cfg.worker, feeds[msg.feed], msg, progress)))


def indices_only(worker: int, feed: OpenFeed, task: Task) -> TaskDone:
    """The benchmark's answer to ``task`` (BENCH_WRITE_NOTHING_ENV): every sample counted as written,
    its index in the slot, no file read and no pixel written."""
    views = slot_views(feed.segment, feed.spec.layout, task.slot, feed.spec.slots)
    indices = np.frombuffer(task.indices, dtype="<i8")
    views.indices[task.row : task.row + len(indices)] = indices
    if views.table is not None:
        views.table[task.row : task.row + len(indices)] = 0  # no row left encoded
    return TaskDone(task.task, worker, len(indices), ())


def _hang_text() -> str:
    """The TEXT of an injected ``hang-on:TEXT`` (FAULT_ENV), "" without one; read once a task."""
    fault = os.environ.get(FAULT_ENV, "")
    return fault[len(HANG_ON) :] if fault.startswith(HANG_ON) else ""


def _injected_hang(feed: OpenFeed, idx: int, text: str) -> None:
    """Stall on reaching a sample whose path contains ``text``, as on a read that never returns,
    until the service kills this worker (``--task-timeout``) or is gone."""
    if not 0 <= idx < len(feed.sources) or text not in str(feed.sources.path(idx)):
        return
    log.warning("sample %d: stalling, fault injected by %s=%s%s", idx, FAULT_ENV, HANG_ON, text)
    parent = os.getppid()  # the template, which ends with the service
    while os.getppid() == parent:
        time.sleep(POLL_MS / 1000)  # a stall, not a wait for anything: only a kill ends it
    sys.exit(0)
