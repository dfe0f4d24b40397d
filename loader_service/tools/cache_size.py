"""``loader-service serve --dry-run``: what each feed's sample cache would need to hold all its samples.

A cache of finished samples (eval, none, a deterministic pipeline) takes the same bytes per sample,
known from the batch layout. A cache of decoded images takes each image's height x width x 3 bytes,
which only the files say: the estimate reads the headers of a random sample of them (JPEG and PNG
headers are parsed here; any other format is decoded), and scales the mean up to the whole dataset
with a 95% margin. Nothing is written to shared memory and no worker starts.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader_service.config import FeedConfig, ServiceConfig
from loader_service.dataset.format import Columns
from loader_service.dataset.index import LOCAL
from loader_service.dataset.sources import FeedSources, index_sources
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import StoreUnavailable
from loader_service.decode.cache import CacheKind, cache_kind, entry_bytes, overhead_bytes
from loader_service.decode.reading import FeedReader
from protocol.pixels import DecodeError
from protocol.pixels.render import decode_bytes

SAMPLED = 1000
"""Images whose headers are read per feed; all of them for a smaller dataset."""
PROGRESS_EVERY = 250
_PNG = b"\x89PNG\r\n\x1a\n"
_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""JPEG frame markers (baseline, progressive, lossless...); C4, C8 and CC share the range but are not."""
_NO_LENGTH = set(range(0xD0, 0xDA)) | {0x01}


@dataclass(frozen=True)
class Estimate:
    samples: int
    looked_at: int
    unreadable: int
    mean_pixels: float
    entry_mean: float
    """Bytes one decoded-image entry takes on average, its header included."""
    entry_margin: float
    """95% half-width of ``entry_mean``, from the spread of the sample."""

    def decoded_bytes(self) -> float:
        return self.mean_pixels * 3 * self.samples

    def cache_bytes(self, workers: int) -> tuple[float, float]:
        """The cache that holds every decoded image, and its 95% margin."""
        return self.entry_mean * self.samples + overhead_bytes(self.samples, workers), (
            self.entry_margin * self.samples
        )


def image_pixels(data: bytes) -> int:
    """Height x width of an encoded image, from its header where it is a JPEG or PNG, else decoded;
    DecodeError if it is neither readable nor decodable. (EXIF rotation swaps the sides, not the product.)"""
    if data.startswith(_PNG) and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return int(width * height)
    if data.startswith(b"\xff\xd8"):
        size = _jpeg_size(data)
        if size is not None:
            return size[0] * size[1]
    image = decode_bytes(data)
    return int(image.shape[0] * image.shape[1])


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header, or None if there is none where it should be."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _NO_LENGTH:
            at += 2
            continue
        if marker in _SOF and at + 9 <= len(data):
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return (height, width) if height and width else None
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        at += 2 + length
    return None


def estimate(
    index: FeedSources,
    max_file_bytes: int,
    sampled: int = SAMPLED,
    progress: Callable[[int, int], None] | None = None,
    storage: StorageConfig = LOCAL,
) -> Estimate:
    """Read the headers of up to ``sampled`` samples, chosen at random (seeded: the same every run)."""
    count = len(index)
    picked = np.random.default_rng(0).permutation(count)[:sampled] if count > sampled else np.arange(count)
    reader = FeedReader(index, max_file_bytes, storage)
    pixels: list[int] = []
    try:
        for done, i in enumerate(picked.tolist(), start=1):
            try:
                pixels.append(image_pixels(reader.image_bytes(i)))
            except (DecodeError, StoreUnavailable):  # an estimate does without a few samples
                pass
            if progress is not None and (done % PROGRESS_EVERY == 0 or done == len(picked)):
                progress(done, len(picked))
    finally:
        reader.close()
    entries = np.asarray([entry_bytes(3 * p) for p in pixels], np.float64)
    spread = float(entries.std(ddof=1)) if len(entries) > 1 else 0.0
    complete = len(picked) == count
    return Estimate(
        samples=count,
        looked_at=len(picked),
        unreadable=len(picked) - len(pixels),
        mean_pixels=float(np.mean(pixels)) if pixels else 0.0,
        entry_mean=float(entries.mean()) if len(entries) else 0.0,
        entry_margin=0.0 if complete else 1.96 * spread / math.sqrt(max(len(entries), 1)),
    )


def describe(
    name: str, kind: CacheKind, estimate: Estimate, row_bytes: int, workers: int
) -> list[str]:  # fmt: skip
    """What ``--dry-run`` prints for one feed."""
    side = math.sqrt(estimate.mean_pixels)
    source = (
        "every sample's header"
        if estimate.looked_at == estimate.samples
        else f"the headers of {estimate.looked_at} random samples"
    )
    lines = [
        f"feed {name}: {estimate.samples} samples; decoded, about {_gib(estimate.decoded_bytes())} "
        f"({side:.0f} x {side:.0f} px on average, from {source}"
        + (f"; {estimate.unreadable} unreadable" if estimate.unreadable else "")
        + ")"
    ]
    if kind is CacheKind.FINAL:
        need = float(entry_bytes(row_bytes) * estimate.samples + overhead_bytes(estimate.samples, workers))
        lines.append(
            f"  its cache keeps finished samples, {row_bytes} bytes each: --cache-memory {_flag(need)} "
            "holds them all"
        )
    else:
        need, margin = estimate.cache_bytes(workers)
        plus = f" (within {_gib(margin)})" if margin else ""
        lines.append(
            f"  its cache keeps decoded images: --cache-memory {_flag(need + margin)} holds them all{plus}; "
            "a smaller one keeps that share of them, the same ones every epoch"
        )
    return lines


def share_held(configured: int, kind: CacheKind, estimate: Estimate, row_bytes: int, workers: int) -> float:
    """About what fraction of the samples a cache of ``configured`` bytes keeps."""
    room = configured - overhead_bytes(estimate.samples, workers)
    per_entry = entry_bytes(row_bytes) if kind is CacheKind.FINAL else estimate.entry_mean
    if estimate.samples == 0 or per_entry <= 0:
        return 1.0
    return max(0.0, min(1.0, room / per_entry / estimate.samples))


def _indexing(count: int) -> None:
    print(f"indexing: {count} samples", file=sys.stderr)


def _row_bytes(feed: FeedConfig, index: FeedSources, timeout: float) -> int:
    """Bytes of one finished sample: the built-in layout's, or what the pipeline returns for sample 0."""
    from loader_service.supervisor.feeds import batch_layout  # runs the probe for a pipeline

    with tempfile.TemporaryDirectory(prefix="dataferry-dry-run-") as folder:
        index.save(Path(folder))
        layout = batch_layout(feed, Path(folder), timeout)
    return sum(f.row_bytes for f in layout.fields)


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _flag(size: float) -> str:
    """A ``--cache-memory`` value at least ``size``, rounded up to a whole MiB or a tenth of a GiB."""
    if size >= 2**30:
        return f"{math.ceil(size / 2**30 * 10) / 10:g}G"
    return f"{math.ceil(size / 2**20)}M"


def print_progress(name: str) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        print(f"feed {name}: read {done}/{total} image headers", file=sys.stderr)

    return report


def dry_run(config: ServiceConfig) -> int:
    """Index every feed and print what its cache would need; nothing is served. The exit code."""
    # As the service does for its workers: the pixel limit holds for the files decoded here too.
    os.environ["OPENCV_IO_MAX_IMAGE_PIXELS"] = str(config.max_pixels)
    for feed in config.feeds():
        columns = Columns(feed.image_column, feed.label_column, feed.label_offset)
        index = index_sources(
            feed.named_sources, feed.format, lambda _source: _indexing, feed.storage, columns
        )
        kind = cache_kind(feed.augment, feed.pipeline, feed.pipeline_deterministic)
        row_bytes = _row_bytes(feed, index, config.task_timeout) if kind is CacheKind.FINAL else 0
        found = estimate(
            index, config.max_file_bytes, progress=print_progress(feed.name), storage=feed.storage
        )
        for line in describe(feed.name, kind, found, row_bytes, config.worker_processes):
            print(line)
        if feed.cache_memory:
            share = share_held(feed.cache_memory, kind, found, row_bytes, config.worker_processes)
            print(f"  configured: --cache-memory {_gib(feed.cache_memory)}, about {share:.0%} of the samples")
    return 0
