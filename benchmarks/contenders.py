"""Contenders as endless streams of batches, so every scenario can drive any of them the same way.

A stream yields one ``Tick`` per batch, after the batch has been received and dropped: a service slot
is released, a DataLoader's shared-memory tensor freed, inside the same ``next()`` that fetched it.
Ticks carry the epoch and the position within it, so scenarios that need epoch boundaries ((d),
(e), (g)) can find them on a stream other scenarios have already advanced.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from benchmarks.service_process import BenchError
from loader_service.dataset.index import DatasetIndex
from loader_service.decode.transforms import Recipe, load_into
from protocol.pixels.geometry import prepare


@dataclass(frozen=True)
class Tick:
    """One delivered batch: which epoch, which position in it, how many images."""

    epoch: int
    position: int
    images: int


Stream = Generator[Tick, None, None]


def batch_rows(batch: Any) -> int:
    """Samples in a batch of any contender: a ``Batch`` or a DataLoader's tuple (by its first field),
    or a DataLoader's collated dict (a pipeline's fields), by its first value."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return int(first.shape[0])


def loader_stream(loader: Iterable[Any]) -> Stream:
    """Epoch after epoch of a ServiceLoader or DataLoader; each batch is dropped before its tick.

    No ``enumerate``: it keeps its last result tuple, and so the previous batch, alive while it
    fetches the next one, which would hold a service slot one batch longer than this loop means to.
    """
    for epoch in itertools.count():
        position = 0
        for batch in loader:
            images = batch_rows(batch)
            del batch
            yield Tick(epoch, position, images)
            position += 1
        if position == 0:
            raise BenchError(f"epoch {epoch} delivered no batch")


def _sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Per-sample randomness built exactly as the service builds it, so it costs the same."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA06])))


def decode_limit_stream(
    index: DatasetIndex, batch_size: int, image_size: int, seed: int, recipe: Recipe
) -> Stream:
    """The service's per-sample work (``load_into`` with the feed's ``recipe``: transform, filter,
    decoder) in this one process, into one reused batch buffer.

    No queues, no shared memory, no delivery: its rate times the process count is the most any
    contender with that many single-threaded processes could deliver (the decode limit).
    """
    cv2.setNumThreads(1)
    prepare(recipe.interpolation)  # single-threaded, as in a decode worker
    out = np.empty((batch_size, 3, image_size, image_size), dtype=np.uint8)
    for epoch in itertools.count():
        order = np.random.default_rng([seed, epoch]).permutation(len(index))
        for position, start in enumerate(range(0, len(order), batch_size)):
            chunk = order[start : start + batch_size].tolist()
            for row, idx in enumerate(chunk):
                load_into(str(index.path(idx)), out[row], recipe, _sample_rng(seed, epoch, idx))
            yield Tick(epoch, position, len(chunk))


class Contender:
    """A named stream plus what scenarios need to know about it.

    ``backlog``: batches that may already be waiting when the stream resumes after idling (a service
    trainer's credits, a DataLoader's prefetch); ``backlog + warmup`` batches are skipped before any
    timing. ``scale`` turns a rate into this contender's figure (the decode limit multiplies its one
    process by the process count).
    """

    def __init__(self, key: str, stream: Stream, backlog: int, warmup: int, scale: float = 1.0) -> None:
        self.key = key
        self.stream = stream
        self.backlog = backlog
        self.warmup = warmup
        self.scale = scale
        self.last: Tick | None = None

    def pull(self) -> Tick:
        self.last = next(self.stream)
        return self.last

    def timed_pull(self) -> tuple[Tick, float]:
        """The next tick and the seconds ``next()`` took."""
        start = time.perf_counter()
        tick = self.pull()
        return tick, time.perf_counter() - start

    def finish_epoch(self, batches_per_epoch: int) -> None:
        """Consume batches until the last one of an epoch has been delivered."""
        while self.last is None or self.last.position != batches_per_epoch - 1:
            tick = self.pull()
            if tick.position >= batches_per_epoch:
                raise BenchError(f"{self.key}: epoch longer than {batches_per_epoch} batches")

    def close(self) -> None:
        """End the stream, so the loader's own iteration ends before the loader is closed."""
        self.stream.close()
