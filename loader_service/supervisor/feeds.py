"""A feed at run time: its dataset index, slot layout, shared-memory pool and counters."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from loader_service.config import FeedConfig
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.sampler import batches_per_epoch, shard_plan, shard_size
from loader_service.decode.worker import WorkerFeed
from loader_service.shm import Segment, new_segment_name
from loader_service.supervisor.rates import RateMeter
from loader_service.supervisor.slots import SlotPool
from protocol.layout import CHECK_BYTES, SlotLayout
from protocol.messages import FeedInfo

log = logging.getLogger(__name__)


@dataclass
class FeedCounters:
    decoded: RateMeter = field(default_factory=RateMeter)
    batches: int = 0
    bad_files: int = 0
    warm_decoded: int = 0
    """Images decoded for the warm cache (NOTE [ Warm start ]), included in ``decoded``."""


@dataclass
class Feed:
    id: int
    config: FeedConfig
    index: DatasetIndex
    layout: SlotLayout
    segment: Segment
    pool: SlotPool
    index_dir: Path
    fingerprint: str = ""
    """Of the index, computed once at open: hashing a large index costs a noticeable fraction of a second."""
    check: str = ""
    """Hex of the bytes after the pool that prove to a trainer it mapped this pool (protocol.layout)."""
    counters: FeedCounters = field(default_factory=FeedCounters)
    bad_files: dict[int, str] = field(default_factory=dict)

    @classmethod
    def open(cls, feed_id: int, config: FeedConfig, runtime_dir: Path, group: str = "") -> Feed:
        """Index the data and create the pool; the caller closes the feed on every exit path."""
        index = build_index(
            config.data, progress=lambda n: log.info("feed %s: indexing, %d files", config.name, n)
        )
        index_dir = runtime_dir / f"feed{feed_id}"
        index_dir.mkdir()
        index.save(index_dir)
        layout = SlotLayout(config.batch_size, config.image_size)
        segment = Segment.create(new_segment_name(config.name), layout.mapped_bytes(config.slots), group)
        check = secrets.token_bytes(CHECK_BYTES)
        pool_end = layout.segment_bytes(config.slots)
        segment.buf[pool_end : pool_end + CHECK_BYTES] = check  # NOTE in protocol.layout
        pool = SlotPool(config.slots)
        return cls(feed_id, config, index, layout, segment, pool, index_dir, index.fingerprint(), check.hex())

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()

    @property
    def name(self) -> str:
        return self.config.name

    def shard_batches(self, world_size: int, remainder: str) -> int:
        return batches_per_epoch(shard_size(len(self.index), world_size, remainder), self.config.batch_size)

    def plan(self, epoch: int, rank: int, world_size: int, remainder: str) -> npt.NDArray[np.int64]:
        return shard_plan(self.config.seed, epoch, len(self.index), rank, world_size, remainder)

    def info(self) -> FeedInfo:
        cfg = self.config
        return FeedInfo(
            name=cfg.name,
            samples=len(self.index),
            classes=len(self.index.classes),
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            batches_per_epoch=self.shard_batches(1, "pad"),
            seed=cfg.seed,
            augment=cfg.augment,
            fingerprint=self.fingerprint,
            segment=self.segment.name,
            slots=cfg.slots,
            check=self.check,
        )

    def worker_feed(self) -> WorkerFeed:
        return WorkerFeed(
            segment=self.segment.name,
            slots=self.config.slots,
            layout=self.layout,
            index_dir=self.index_dir,
            data=self.config.data,
            seed=self.config.seed,
            augment=self.config.augment,
            max_file_bytes=self.config.max_file_bytes,
        )

    def slot_frames(self, slot: int, count: int) -> list[memoryview]:
        """The first ``count`` rows of a slot's images, labels and indices, as views of shared
        memory: what a remote trainer is sent, without a copy."""
        start = self.layout.slot_offset(slot, self.config.slots)
        whole = memoryview(self.segment.buf)
        parts = (
            (0, count * self.layout.image_bytes),
            (self.layout.labels_offset, 8 * count),
            (self.layout.indices_offset, 8 * count),
        )
        return [whole[start + offset : start + offset + size] for offset, size in parts]

    def note_bad(self, index: int, reason: str) -> None:
        self.counters.bad_files += 1
        if index not in self.bad_files and 0 <= index < len(self.index):
            self.bad_files[index] = reason
            log.warning("feed %s: bad file skipped: %s: %s", self.name, self.index.relpath(index), reason)

    def status(self) -> dict[str, object]:
        recent = [self.index.relpath(i)[-200:] for i in list(self.bad_files)[-5:]]
        return {
            "name": self.name,
            "samples": len(self.index),
            "slots": self.pool.counts(),
            "slots_sending": self.pool.sending,
            "decoded": self.counters.decoded.total,
            "images_per_second": round(self.counters.decoded.rate(), 1),
            "warm_decoded": self.counters.warm_decoded,
            "batches": self.counters.batches,
            "bad_files": self.counters.bad_files,
            "recent_bad_files": recent,
        }
