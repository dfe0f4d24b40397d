"""What the service's main process and its decode workers share, free of OpenCV, the decoders and
users' pipelines.

NOTE [ The worker contract ]
    The main process plans, schedules and serves; only decode workers decode. So it imports this
    module, never ``decode.worker`` (OpenCV, numpy's decoders and, in a worker, the users'
    pipelines): the frozen ``WorkerConfig`` a worker is started with, the views of a slot both
    sides compute alike, the exit codes and environment variables between them, and the names
    config checks (the resize filters, a pipeline's spec). The workers themselves are started
    through ``supervisor.worker_pool``'s entry point, which imports ``decode.worker`` in the worker
    only. ``tests/unit/test_boundaries.py`` keeps OpenCV out of ``supervisor/`` and ``config/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.index import LOCAL
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.decode.cache import CacheSpec
from loader_service.shm import Segment
from protocol.encoded import COLUMNS
from protocol.layout import SlotLayout

WORKER_BOOT_ERROR = 3
"""Exit code of a worker that could not start; the supervisor backs off instead of looping."""
FAULT_ENV = "DATAFERRY_INJECT_FAULT"
"""Fault injection for tests: ``worker-boot`` makes every decode worker fail at start-up;
``main-loop`` makes the service's main loop raise as it begins; ``hang-on:TEXT`` makes a worker
stall, as on a read that never returns, on every task holding a path that contains TEXT."""
HANG_ON = "hang-on:"
BENCH_WRITE_NOTHING_ENV = "DATAFERRY_BENCH_WRITE_NOTHING"
"""Benchmark-only hook (``benchmarks.loop_cost``): ``1`` makes every decode worker answer each task
at once, writing only the slot's sample indices, so a run measures the service's main loop with
decoding taken out. Read once by the supervisor (``service``), which logs a warning; never set
it for training: the batches hold whatever pixels the slot held before."""
PIPELINES_ENV = "DATAFERRY_TEMPLATE_PIPELINES"
"""The feeds' pipelines the worker template imports before it forks (NOTE [ Workers from a
template ]), one spec a line."""
TEMPLATE_FOLDER_ENV = "DATAFERRY_TEMPLATE_FOLDER"
"""The service's working folder, where the template looks for a ``package.module:FUNC`` pipeline as
the workers do; the template itself runs in the service's private folder (NOTE [ Nothing from the
working folder ])."""
PIPELINE_REASON = "pipeline: "
"""How the reason of a sample the pipeline itself failed on starts (the service logs each such
reason once, however many samples share it)."""
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Thread-count variables a worker sets to 1 before a pipeline is imported (``single_threaded``)."""

INTERPOLATIONS = ("bilinear-antialias", "bilinear", "area")
"""The resize filters, default first. ``bilinear-antialias`` is torchvision's default (its tensor
resize, ``antialias=True``; PIL's bilinear is within one level of it); ``bilinear`` is OpenCV's
``INTER_LINEAR``, what a plain ``cv2.resize`` pipeline does; ``area`` is OpenCV's ``INTER_AREA`` when
shrinking (bilinear when enlarging)."""

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_SPEC = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*$")
_FUNC = re.compile(rf"^{_IDENTIFIER}$")


class PipelineError(Exception):
    """A pipeline that cannot run at all (import failure, or failure on sample 0 at start).

    ``str()`` is what the operator reads, with the user's traceback; the service exits 2 with it.
    """


def parse_spec(spec: str) -> tuple[str, str]:
    """``FILE.py:FUNC`` or ``package.module:FUNC`` -> (file or module, function); ValueError if neither."""
    target, _, func = spec.rpartition(":")
    # One colon: a file path holding another would be read differently by the reader of the spec.
    if not target or ":" in target or not _FUNC.match(func):
        raise ValueError(f"pipeline must be FILE.py:FUNC or package.module:FUNC, got {spec!r}")
    if not target.endswith(".py") and not _MODULE_SPEC.match(target):
        raise ValueError(f"pipeline {spec!r}: {target!r} is neither a .py file nor a module name")
    return target, func


@dataclass(frozen=True)
class WorkerFeed:
    """What a worker needs to fill slots for one feed."""

    segment: str
    slots: int
    layout: SlotLayout
    index_dir: Path
    """Where the service saved the feed's index (``DatasetIndex.load``)."""
    seed: int
    augment: str
    """The built-in transform (train, eval, none); unused with a pipeline."""
    interpolation: str
    """The built-in transforms' resize filter (``geometry.INTERPOLATIONS``)."""
    pipeline: str
    """``FILE.py:FUNC`` or ``package.module:FUNC`` (``decode.pipeline``); "" for the built-in transforms."""
    max_file_bytes: int
    """A larger file or tar member is a bad sample (``dataset.storage.read_file``)."""
    storage: StorageConfig = LOCAL
    """How to reach the data's object store, if it is in one."""
    cache: CacheSpec | None = None
    """The feed's decoded-sample cache (NOTE [ Sample cache ]), if it has one."""


@dataclass(frozen=True)
class WorkerConfig:
    worker: int
    parent_pid: int
    parent_start: str
    """The service's start time (``shm.process_start``), taken by the service itself: a worker
    forked after the service died (a replacement started as it stopped) knows it is gone."""
    backend: str
    feeds: tuple[WorkerFeed, ...]
    log_level: str
    roi: bool = False
    """Decode train and eval crops with the region decoder (``transforms.load_bytes_into``)."""
    write_nothing: bool = False
    """Answer every task without reading or decoding anything (BENCH_WRITE_NOTHING_ENV)."""
    progress: str = ""
    """The service's progress page (NOTE [ Per-sample progress ]); "" writes none."""
    workers: int = 1
    """How many workers the page has room for."""


@dataclass(frozen=True)
class SlotViews:
    fields: dict[str, npt.NDArray[Any]]
    """Each field's ``[capacity, *shape]`` rows, by name."""
    indices: npt.NDArray[np.int64]
    table: npt.NDArray[np.int64] | None = None
    """The encoded rows' table, ``[capacity, COLUMNS]``; None where the feed offers none (NOTE
    [ Encoded rows ] in protocol/encoded.py)."""
    encoded: npt.NDArray[np.uint8] | None = None
    """The encoded rows' bytes, ``capacity * layout.encoded`` of them."""


def slot_views(segment: Segment, layout: SlotLayout, slot: int, slots: int) -> SlotViews:
    base = layout.slot_offset(slot, slots)
    cap = layout.capacity
    table = encoded = None
    if layout.encoded:
        table = np.ndarray((cap, COLUMNS), np.int64, segment.buf, base + layout.table_offset)
        encoded = np.ndarray((layout.encoded_area,), np.uint8, segment.buf, base + layout.bytes_offset)
    return SlotViews(
        fields={
            f.name: np.ndarray((cap, *f.shape), f.dtype, segment.buf, base + offset)
            for f, offset in zip(layout.fields, layout.offsets, strict=True)
        },
        indices=np.ndarray((cap,), np.int64, segment.buf, base + layout.indices_offset),
        table=table,
        encoded=encoded,
    )
