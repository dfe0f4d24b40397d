"""(b) and (h)'s group: several trainers reading the same data at once, each in its own process.

One side attaches ``trainers`` ServiceLoaders to ONE service; the other runs as many independent
DataLoaders (OpenCV crops; for (h), the service's pipeline), each with its own ``workers`` processes,
as separate jobs would. Each trainer gets every image, waits at a common barrier, skips a warm-up,
times a fixed number of batches, reports, then keeps consuming until every trainer has reported, so
that no trainer is timed against fewer competitors than the others.

The service side takes ``loader_kwargs`` for every ServiceLoader, so a decode-once mode can be
benchmarked by passing e.g. ``{"mode": "broadcast", "group": "bench", "group_size": 4}``.

Trainer failures travel to the parent as data (the traceback, with the trainer's pid) and fail the
run there; a trainer that dies without a word is named by its pid and exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

from benchmarks.contenders import Stream, loader_stream
from benchmarks.proctree import tree
from benchmarks.results import DL_OPENCV, SERVICE, Measurement
from benchmarks.service_process import BenchError
from benchmarks.stats import rate

STARTUP_SECONDS = 90.0
"""Allowance for spawning trainers and importing torch in each, on top of the per-batch timeout."""


@dataclass(frozen=True)
class TrainerConfig:
    """What one spawned trainer needs; ``side`` is ``service`` or ``dataloader``."""

    trainer: int
    side: str
    data: Path
    workers: int
    batch_size: int
    image_size: int
    warmup_batches: int
    timed_batches: int
    timeout: float
    endpoint: str = ""
    loader_kwargs: Mapping[str, Any] = field(default_factory=dict)
    pipeline: str = ""
    """(h): the DataLoader side runs this ``FILE.py:FUNC`` (``PipelineSamples``) instead of OpenCV crops."""
    seed: int = 0
    """(h): the seed the service was started with, so a pipeline DataLoader makes the same samples."""


@dataclass(frozen=True)
class TrainerReport:
    trainer: int
    images: int
    seconds: float
    error: str = ""


@contextlib.contextmanager
def _stream(cfg: TrainerConfig) -> Iterator[Stream]:
    """The trainer's batches; the loader is closed (and its workers stopped) on the way out."""
    if cfg.side == "service":
        from gpu_worker import ServiceLoader

        kwargs = {
            "device": "cpu",
            "timeout": cfg.timeout,
            "connect_timeout": cfg.timeout,
            **cfg.loader_kwargs,
        }
        with ServiceLoader(cfg.endpoint, **kwargs) as loader:
            stream = loader_stream(loader)
            try:
                yield stream
            finally:
                stream.close()
        return
    stream = loader_stream(_dataloader(cfg))
    try:
        yield stream
    finally:
        stream.close()


def _dataloader(cfg: TrainerConfig) -> Iterable[Any]:
    """The DataLoader of a ``dataloader`` trainer: OpenCV crops, or (h) the service's pipeline."""
    from benchmarks.datasets import (
        OpenCVCrops,
        PipelineSamples,
        make_dataloader,
        make_pipeline_dataloader,
    )

    if cfg.pipeline:
        dataset = PipelineSamples(cfg.data, cfg.pipeline, cfg.seed)
        return make_pipeline_dataloader(dataset, cfg.workers, cfg.batch_size, cfg.timeout)
    return make_dataloader(OpenCVCrops(cfg.data, cfg.image_size), cfg.workers, cfg.batch_size, cfg.timeout)


def _timed(cfg: TrainerConfig, stream: Stream, start: Barrier) -> TrainerReport:
    next(stream)  # attached, workers up: the barrier then starts everyone's load together
    start.wait(cfg.timeout + STARTUP_SECONDS)
    for _ in range(cfg.warmup_batches):
        next(stream)
    began = time.perf_counter()
    images = sum(next(stream).images for _ in range(cfg.timed_batches))
    return TrainerReport(cfg.trainer, images, time.perf_counter() - began)


def trainer_main(cfg: TrainerConfig, start: Barrier, stop: Event, reports: Queue[TrainerReport]) -> None:
    """Entry point of one spawned trainer process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when trainers stop
    try:
        with _stream(cfg) as stream:
            reports.put(_timed(cfg, stream, start))
            deadline = time.monotonic() + cfg.timeout
            while not stop.is_set() and time.monotonic() < deadline:
                next(stream)
    except BaseException:
        start.abort()  # the others must not wait at the barrier for a trainer that is gone
        where = f"trainer {cfg.trainer} ({cfg.side}, pid {os.getpid()})"
        reports.put(TrainerReport(cfg.trainer, 0, 0.0, f"{where}:\n{traceback.format_exc()}"))


def _kill_tree(process: BaseProcess) -> None:
    """SIGKILL a trainer and everything it started (its DataLoader workers)."""
    if process.pid is None:
        return
    for pid in reversed(tree(process.pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.join(5)


def _collect(
    reports: Queue[TrainerReport], procs: Sequence[BaseProcess], deadline: float
) -> list[TrainerReport]:
    """One report per trainer, or BenchError naming what went wrong."""
    got: dict[int, TrainerReport] = {}
    while len(got) < len(procs):
        if time.monotonic() > deadline:
            raise BenchError(f"trainers reported {len(got)} of {len(procs)} results in time")
        try:
            report = reports.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(
                    f"trainer pid {dead[0].pid} died with exit code {dead[0].exitcode}"
                ) from None
            continue
        if report.error:
            raise BenchError(report.error)
        got[report.trainer] = report
    return [got[i] for i in sorted(got)]


def run_trainers(configs: Sequence[TrainerConfig]) -> list[TrainerReport]:
    """Spawn one process per config, gather their reports, then stop and reap them all."""
    ctx = mp.get_context("spawn")
    start, stop = ctx.Barrier(len(configs)), ctx.Event()
    reports: Queue[TrainerReport] = ctx.Queue()
    procs = [
        ctx.Process(target=trainer_main, args=(c, start, stop, reports), name=f"bench-trainer-{c.trainer}")
        for c in configs
    ]
    timeout = max(c.timeout for c in configs)
    try:
        for p in procs:
            p.start()
        results = _collect(reports, procs, time.monotonic() + STARTUP_SECONDS + timeout)
        stop.set()
        for p in procs:
            p.join(timeout)
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                _kill_tree(p)
    return results


def service_trainers(
    base: TrainerConfig, count: int, endpoint: str, loader_kwargs: dict[str, Any]
) -> list[float]:
    """Per-trainer images/s of ``count`` ServiceLoaders on the service at ``endpoint``.

    ``loader_kwargs`` go to every ServiceLoader unchanged (e.g. a broadcast group's mode, group and
    group_size).
    """
    configs = [
        replace(base, trainer=i, side="service", endpoint=endpoint, loader_kwargs=loader_kwargs)
        for i in range(count)
    ]
    return [rate(r.images, r.seconds) for r in run_trainers(configs)]


def dataloader_trainers(base: TrainerConfig, count: int) -> list[float]:
    """Per-trainer images/s of ``count`` independent DataLoaders, each with ``base.workers`` workers."""
    configs = [replace(base, trainer=i, side="dataloader") for i in range(count)]
    return [rate(r.images, r.seconds) for r in run_trainers(configs)]


def measure_trainers(
    base: TrainerConfig,
    count: int,
    endpoint: str,
    loader_kwargs: dict[str, Any],
    key: str = "b",
    other: str = DL_OPENCV,
) -> Measurement:
    """(b), or (h)'s group (``key``): per-trainer images/s, service side then DataLoader side
    (``other`` names the DataLoader contender)."""
    samples = {
        SERVICE: service_trainers(base, count, endpoint, loader_kwargs),
        other: dataloader_trainers(base, count),
    }
    notes = {"trainers": float(count)}
    scenario = key[0]
    return Measurement(
        scenario, key, f"per trainer, {count} trainers at once", "images/s", samples, notes=notes
    )
