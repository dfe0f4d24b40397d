"""A decode worker process: takes tasks from the service, decodes images straight into slots.

Each worker is spawned (never forked: the service holds sockets and threads) and gets one frozen
``WorkerConfig``. It maps the dataset index and the slot segment read/write, and answers every task
with ``done``: the rows written and the samples that could not be decoded, which are data, not crashes.
It exits on ``stop``, and by itself when its parent is gone (checked between polls).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt
import zmq

from loader_service.dataset.index import DatasetIndex
from loader_service.dataset.sampler import sample_rng
from loader_service.decode.transforms import DecodeError, load_into
from loader_service.logs import configure_logging
from loader_service.shm import Segment
from protocol.layout import SlotLayout
from protocol.messages import MAX_BAD_REPORTS, StopWorker, Task, TaskDone, WorkerReady, decode, encode

log = logging.getLogger(__name__)
POLL_MS = 500
WORKER_BOOT_ERROR = 3
"""Exit code of a worker that could not start; the supervisor backs off instead of looping."""
FAULT_ENV = "DATAFERRY_INJECT_FAULT"
"""Fault injection for tests: ``worker-boot`` makes every decode worker fail at start-up;
``main-loop`` makes the service's main loop raise as it begins; ``hang-on:TEXT`` makes a worker
stall, as on a read that never returns, on every task holding a path that contains TEXT."""
HANG_ON = "hang-on:"


@dataclass(frozen=True)
class WorkerFeed:
    """What a worker needs to decode for one feed."""

    segment: str
    slots: int
    layout: SlotLayout
    index_dir: Path
    data: Path
    seed: int
    augment: str
    max_file_bytes: int
    """A larger file is a bad sample (``transforms.read_file``)."""


@dataclass(frozen=True)
class WorkerConfig:
    worker: int
    parent_pid: int
    backend: str
    feeds: tuple[WorkerFeed, ...]
    log_level: str
    roi: bool = False
    """Decode train crops with the region decoder (``transforms.load_into``)."""


@dataclass
class OpenFeed:
    spec: WorkerFeed
    index: DatasetIndex
    segment: Segment


@dataclass(frozen=True)
class SlotViews:
    images: npt.NDArray[np.uint8]
    labels: npt.NDArray[np.int64]
    indices: npt.NDArray[np.int64]


def slot_views(segment: Segment, layout: SlotLayout, slot: int, slots: int) -> SlotViews:
    base = layout.slot_offset(slot, slots)
    cap = layout.capacity
    return SlotViews(
        images=np.ndarray((cap, *layout.image_shape), np.uint8, segment.buf, base),
        labels=np.ndarray((cap,), np.int64, segment.buf, base + layout.labels_offset),
        indices=np.ndarray((cap,), np.int64, segment.buf, base + layout.indices_offset),
    )


def fill_slot(worker: int, feed: OpenFeed, task: Task, roi: bool) -> TaskDone:
    """Decode ``task``'s samples into consecutive rows, skipping (and reporting) bad files."""
    spec, index = feed.spec, feed.index
    views = slot_views(feed.segment, spec.layout, task.slot, spec.slots)
    row = 0
    bad: list[tuple[int, str]] = []
    for idx in np.frombuffer(task.indices, dtype="<i8").tolist():
        if not 0 <= idx < len(index):
            bad.append((idx, "index outside dataset"))
            continue
        try:
            rng = sample_rng(spec.seed, task.epoch, idx)
            load_into(str(index.path(idx)), views.images[row], spec.augment, rng, roi, spec.max_file_bytes)
        except DecodeError as exc:
            bad.append((idx, str(exc)))
            continue
        except Exception as exc:  # an OpenCV failure on one file must not take the worker down
            bad.append((idx, f"{type(exc).__name__}: {exc}"[:200]))
            continue
        views.labels[row] = index.labels[idx]
        views.indices[row] = idx
        row += 1
    return TaskDone(task.task, worker, row, tuple(bad[:MAX_BAD_REPORTS]))


def run_worker(cfg: WorkerConfig) -> None:
    """Entry point of a spawned decode worker."""
    configure_logging(cfg.log_level, f"worker-{cfg.worker}")
    # Ctrl-C reaches the whole process group; the service decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cv2.setNumThreads(1)
    try:
        feeds = _open_feeds(cfg)
    except Exception as exc:
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        sys.exit(WORKER_BOOT_ERROR)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(cfg.backend)
        sock.send(encode(WorkerReady(cfg.worker, os.getpid())))
        _serve(cfg, feeds, sock)
    finally:
        sock.close(linger=0)
        ctx.term()
        for feed in feeds:
            feed.segment.close()


def _open_feeds(cfg: WorkerConfig) -> list[OpenFeed]:
    if os.environ.get(FAULT_ENV) == "worker-boot":
        raise RuntimeError(f"fault injected by {FAULT_ENV}")
    return [
        OpenFeed(
            f,
            DatasetIndex.load(f.index_dir, f.data),
            Segment.attach(f.segment, f.layout.segment_bytes(f.slots)),
        )
        for f in cfg.feeds
    ]


def _serve(cfg: WorkerConfig, feeds: list[OpenFeed], sock: zmq.Socket[bytes]) -> None:
    while True:
        if not sock.poll(POLL_MS):
            if os.getppid() != cfg.parent_pid:
                log.warning("service process %d is gone; exiting", cfg.parent_pid)
                return
            continue
        msg = decode(sock.recv(), (Task, StopWorker))
        if not isinstance(msg, Task):
            return  # stop
        if not 0 <= msg.feed < len(feeds):
            log.error("task %d names feed %d of %d; ignored", msg.task, msg.feed, len(feeds))
            continue
        _injected_hang(cfg, feeds[msg.feed], msg)
        sock.send(encode(fill_slot(cfg.worker, feeds[msg.feed], msg, cfg.roi)))


def _injected_hang(cfg: WorkerConfig, feed: OpenFeed, task: Task) -> None:
    """``hang-on:TEXT`` (FAULT_ENV): stall on a task holding a path that contains TEXT, until the
    service kills this worker (``--task-timeout``) or is gone itself."""
    fault = os.environ.get(FAULT_ENV, "")
    if not fault.startswith(HANG_ON) or not _names(feed, task, fault[len(HANG_ON) :]):
        return
    log.warning("task %d: stalling, fault injected by %s=%s", task.task, FAULT_ENV, fault)
    while os.getppid() == cfg.parent_pid:
        time.sleep(POLL_MS / 1000)  # a stall, not a wait for anything: only a kill ends it
    sys.exit(0)


def _names(feed: OpenFeed, task: Task, text: str) -> bool:
    indices = np.frombuffer(task.indices, dtype="<i8").tolist()
    return any(text in str(feed.index.path(i)) for i in indices if 0 <= i < len(feed.index))
