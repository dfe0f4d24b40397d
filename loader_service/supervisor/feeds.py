"""A feed at run time: its dataset index, slot layout, shared-memory pool and counters."""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from loader_service.config import ConfigError, FeedConfig
from loader_service.config.feed import AUTO_ENCODED_ROW_BYTES
from loader_service.dataset.format import Columns
from loader_service.dataset.mixture import Mixture, MixtureEpoch, integer_weights
from loader_service.dataset.sampler import ShardOrder, shard_order
from loader_service.dataset.sources import FeedSources, index_sources
from loader_service.dataset.tables import DatasetError
from loader_service.decode.cache import LOCK_NAME, CacheKind, CacheSegment, CacheTooSmall, cache_kind
from loader_service.decode.contract import PIPELINE_REASON, PipelineError, WorkerFeed
from loader_service.decode.probe import probe_fields
from loader_service.shm import Segment, new_segment_name, shm_room
from loader_service.supervisor.rates import FeedCounters
from loader_service.supervisor.slots import SlotPool
from loader_service.supervisor.trainers.sessions import credit_cap
from protocol.encoded import COLUMNS, LENGTH, OFFSET, bytes_named
from protocol.layout import CHECK_BYTES, PAGE, SlotLayout, describe_fields, image_fields
from protocol.messages import MAX_WHERE, FeedInfo, Hello
from protocol.shares import rank_batches, shard_size
from protocol.status import FeedSource, FeedStatus

log = logging.getLogger(__name__)
PROBE_START_ALLOWANCE = 60.0
"""Seconds the start-up run of a pipeline gets beyond ``--task-timeout``: a fresh interpreter importing
torch takes 3-5 s here, torchvision more, and a cold page cache several times that."""
RECENT_BAD = 5
"""Bad samples status names, the latest last."""
MAX_LOGGED_REASONS = 10_000
"""Distinct pipeline failures logged at WARNING; later ones go to DEBUG, so memory stays bounded."""


@dataclass
class Feed:
    id: int
    config: FeedConfig
    sources: FeedSources
    """The feed's sources (one for a feed of one ``--data``), their samples numbered one after another."""
    layout: SlotLayout
    segment: Segment
    pool: SlotPool
    index_dir: Path
    fingerprint: str = ""
    """Of the index, computed once at open: hashing a large index costs a noticeable fraction of a second."""
    check: str = ""
    """Hex of the bytes after the pool that prove to a trainer it mapped this pool (protocol.layout)."""
    cache: CacheSegment | None = None
    """The decoded-sample cache (NOTE [ Sample cache ]), with ``cache_memory`` set."""
    counters: FeedCounters = field(default_factory=FeedCounters)
    _bad_seen: npt.NDArray[np.bool_] = field(init=False)
    """One flag per sample: bad at least once (logged then). A byte a sample, however many are bad."""
    _recent_bad: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_BAD))
    _logged_reasons: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._bad_seen = np.zeros(len(self.sources), bool)

    @classmethod
    def open(
        cls,
        feed_id: int,
        config: FeedConfig,
        runtime_dir: Path,
        group: str = "",
        probe_timeout: float = 120.0,
        workers: int = 1,
    ) -> Feed:
        """Index the data, settle the batch layout and create the pool and cache; the caller closes
        the feed on every exit path. DatasetError (bad source), PipelineError (a pipeline that cannot
        run) or ConfigError (a cache too small for its table): the service refuses to start."""
        built = index_sources(
            config.named_sources,
            config.format,
            functools.partial(_indexing, config),
            config.storage,
            Columns(config.image_column, config.label_column, config.label_offset),
        )
        index_dir = runtime_dir / f"feed{feed_id}"
        index_dir.mkdir()
        built.save(index_dir)
        # Keep the saved copy, mapped: its pages are the ones every worker maps, held once.
        index = FeedSources.load(index_dir)
        layout = batch_layout(config, index_dir, probe_timeout)
        pool_end = layout.segment_bytes(config.slots)
        # NOTE [ A pool as large as what is in flight ]: the first slots and the check page now; of
        # each slot, its room for encoded rows only once a batch there uses it (SlotPool.room).
        ahead = layout.bytes_offset if layout.encoded else layout.stride
        first = config.first_slots or config.slots
        reserve = (*((slot * layout.stride, ahead) for slot in range(first)), (pool_end, PAGE))
        segment = Segment.create(
            new_segment_name(config.name), layout.mapped_bytes(config.slots), group, reserve=reserve
        )
        try:
            cache = _cache(config, len(index), workers, index_dir)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        check = secrets.token_bytes(CHECK_BYTES)
        segment.buf[pool_end : pool_end + CHECK_BYTES] = check  # NOTE in protocol.layout
        pool = SlotPool(first, config.slots, segment, layout.stride, config.name, ahead=ahead)
        fingerprint = index.fingerprint()
        return cls(feed_id, config, index, layout, segment, pool, index_dir, fingerprint, check.hex(), cache)

    def grow_pool(self) -> bool:
        """One more slot for a trainer's batch, if the pool may grow and /dev/shm holds it above its
        floor (NOTE [ A pool as large as what is in flight ])."""
        return self.pool.grow()

    def reach(self) -> int:
        """The slots the pool may have now: those it has and what /dev/shm holds above its floor,
        at most its capacity (NOTE [ Credits per session ])."""
        return min(self.pool.capacity, len(self.pool) + shm_room() // self.layout.stride)

    @property
    def image_size(self) -> int:
        """The built-in transforms' output size; 0 for a pipeline, whose fields say what a sample is."""
        return 0 if self.config.pipeline else self.config.image_size

    @property
    def augment(self) -> str:
        """What makes the samples: a built-in transform's name, or ``pipeline``."""
        return "pipeline" if self.config.pipeline else self.config.augment

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    @property
    def name(self) -> str:
        return self.config.name

    def shard_batches(self, world_size: int, remainder: str, offset: int = 0, samples: int = 0) -> int:
        """Batches of each rank's share of an epoch of ``samples`` (0: the feed's size; a mixture
        sets its own) shared out from position ``offset`` on."""
        return rank_batches(
            samples or len(self.sources), self.config.batch_size, world_size, remainder, offset
        )

    def plan(
        self,
        epoch: int,
        rank: int,
        world_size: int,
        remainder: str,
        offset: int = 0,
        order: MixtureEpoch | None = None,
    ) -> ShardOrder:
        """A rank's order of ``epoch`` from ``offset`` on (NOTE [ Elastic epochs ] in
        protocol/shares.py): O(1) to make and to keep, each batch computed when planned. With a
        weighted job's ``order``, that epoch of its mixture (NOTE [ Mixture order ])."""
        if order is None:
            return shard_order(
                self.config.seed, epoch, len(self.sources), rank, world_size, remainder, offset
            )
        samples = order.samples
        if not 0 <= offset < samples:
            raise ValueError(f"an epoch of {samples} samples cannot resume at position {offset}")
        size = shard_size(samples - offset, world_size, remainder)
        return ShardOrder(order, rank, world_size, size, offset)

    def refusal(self, hello: Hello) -> str | None:
        """Why this feed cannot serve a trainer's batches as its hello asks them, or None."""
        cfg, image_size = self.config, self.image_size
        if hello.batch_size not in (0, cfg.batch_size) or hello.image_size not in (0, image_size):
            served = f"{image_size}px images" if image_size else "a pipeline's fields, not a fixed image size"
            return (
                f"feed {self.name!r} serves batches of {cfg.batch_size} samples of {served}; "
                f"this trainer asked for {hello.batch_size or 'any'} of {hello.image_size or 'any'}px"
            )
        return None

    def mixture_of(self, hello: Hello) -> Mixture | None:
        """The mixture a trainer's weights ask for; None without weights. DatasetError naming what
        is wrong with them (NOTE [ Mixture order ])."""
        if not hello.weights:
            if hello.epoch_samples:
                raise DatasetError("epoch_samples needs weights: without them an epoch is every sample once")
            return None
        if not self.config.sources:
            raise DatasetError(
                f"feed {self.name!r} reads one dataset (--data): weights need named sources "
                "(--source NAME=DATA)"
            )
        given = dict(hello.weights)
        if len(given) != len(hello.weights):
            raise DatasetError("weights name a source twice")
        weights = integer_weights(given, self.sources.names)
        sizes = tuple(len(index) for index in self.sources.indexes)
        return Mixture.of(sizes, self.config.seed, hello.epoch_samples or len(self.sources), weights)

    def info(self, mixture: Mixture | None = None) -> FeedInfo:
        """What a trainer is told of the feed; with a ``mixture``, its epoch's length and a
        fingerprint of the weights too, so a checkpoint of other weights is refused."""
        cfg = self.config
        samples = mixture.epoch_samples if mixture is not None else len(self.sources)
        fingerprint = self.fingerprint
        if mixture is not None:
            described = f"{fingerprint}:{samples}:{((0, mixture.weights),)!r}"  # the hello's weights
            fingerprint = hashlib.sha256(described.encode()).hexdigest()[:32]
        return FeedInfo(
            name=cfg.name,
            samples=samples,
            classes=self.sources.num_classes,
            batch_size=cfg.batch_size,
            image_size=self.image_size,
            batches_per_epoch=self.shard_batches(1, "pad", 0, samples),
            seed=cfg.seed,
            augment=self.augment,
            fingerprint=fingerprint,
            segment=self.segment.name,
            slots=cfg.slots,
            fields=self.layout.wire(),
            check=self.check,
            decoding=decoding_of(self.config, self.cache),
            sources=self.sources.names if cfg.sources else (),
            source_sizes=tuple(len(i) for i in self.sources.indexes) if cfg.sources else (),
            data=cfg.data[:MAX_WHERE],  # a path is shorter; a longer pattern or URL fails the compare
            pipeline=cfg.pipeline[:MAX_WHERE],
            encoded=self.layout.encoded,
        )

    def worker_feed(self) -> WorkerFeed:
        return WorkerFeed(
            segment=self.segment.name,
            slots=self.config.slots,
            layout=self.layout,
            index_dir=self.index_dir,
            seed=self.config.seed,
            augment=self.config.augment,
            interpolation=self.config.interpolation,
            pipeline=self.config.pipeline,
            max_file_bytes=self.config.max_file_bytes,
            storage=self.config.storage,
            cache=None if self.cache is None else self.cache.spec,
        )

    def slot_frames(self, slot: int, count: int) -> list[memoryview]:
        """The first ``count`` rows of each of a slot's fields, then its indices, as views of shared
        memory: what a remote trainer is sent a copy of (NOTE [ Remote sends ]); for a feed that
        offers encoded rows, then the table's ``count`` rows and the bytes up to the last they name."""
        layout = self.layout
        start = layout.slot_offset(slot, self.config.slots)
        whole = memoryview(self.segment.buf)
        frames = [whole[start + offset : start + offset + size] for offset, size in layout.parts(count)]
        if layout.encoded:  # the table's rows and the bytes they name (NOTE [ Encoded rows ])
            table = np.ndarray((count, COLUMNS), np.int64, self.segment.buf, start + layout.table_offset)
            end = bytes_named(table[:, OFFSET].tolist(), table[:, LENGTH].tolist(), layout.encoded_area)
            frames.append(whole[start + layout.table_offset : start + layout.table_offset + table.nbytes])
            frames.append(whole[start + layout.bytes_offset : start + layout.bytes_offset + end])
        return frames

    def slot_indices(self, slot: int, count: int) -> npt.NDArray[np.int64]:
        """The sample numbers a slot's worker wrote for its first ``count`` rows (a view)."""
        start = self.layout.slot_offset(slot, self.config.slots) + self.layout.indices_offset
        return np.ndarray((count,), np.int64, self.segment.buf, start)

    def note_bad(self, index: int, reason: str) -> None:
        """Count a skipped sample, and log it: a bad file once, a pipeline failure once per reason.

        An operator fixes bad files one by one, so each is named. A pipeline bug fails sample after
        sample with the same reason: one line (with the first sample's path) says it, and the rest
        would bury the log (status keeps the count and the latest names).
        """
        self.counters.bad_files += 1
        if not 0 <= index < len(self.sources):
            return
        if self._bad_seen[index]:
            return
        self._bad_seen[index] = True
        self._recent_bad.append(index)
        where = self.sources.relpath(index)
        if reason.startswith(PIPELINE_REASON):
            if reason in self._logged_reasons or len(self._logged_reasons) >= MAX_LOGGED_REASONS:
                log.debug("feed %s: bad sample skipped: %s: %s", self.name, where, reason)
                return
            self._logged_reasons.add(reason)
        log.warning("feed %s: bad sample skipped: %s: %s", self.name, where, reason)

    def status(self) -> FeedStatus:
        return FeedStatus(
            name=self.name,
            samples=len(self.sources),
            slots=self.pool.counts(),
            slots_most=self.pool.capacity,
            credits_most=credit_cap(self.reach()),
            pool_refused=self.pool.refused,
            pool_given_back=self.pool.given_back,
            encoded_room_refused=self.pool.room_refused,
            decoded=self.counters.decoded.total,
            images_per_second=round(self.counters.decoded.rate(), 1),
            warm_decoded=self.counters.warm_decoded,
            split_batches=self.counters.split_batches,
            encoded_rows=self.counters.encoded,
            encoded_row_bytes=self.layout.encoded,
            batches=self.counters.batches,
            bad_files=self.counters.bad_files,
            store_waits=self.counters.store_waits,
            recent_bad_files=tuple(self.sources.relpath(i)[-200:] for i in self._recent_bad),
            format=self.sources.kind,
            augment=self.augment,
            interpolation="" if self.config.pipeline else self.config.interpolation,
            fields=tuple(f.describe() for f in self.layout.fields),
            cache=None if self.cache is None else self.cache.stats().status(self.cache.kind),
            sources=self._source_status(),
        )

    def _source_status(self) -> tuple[FeedSource, ...]:
        """Rows served by source, for a feed of several (NOTE [ Source ledger ])."""
        served = self.counters.served_by_source
        if len(self.sources.names) < 2:
            return ()
        return tuple(
            FeedSource(source=name, samples=len(index), served=0 if served is None else int(served[s]))
            for s, (name, index) in enumerate(zip(self.sources.names, self.sources.indexes, strict=True))
        )


def decoding_of(config: FeedConfig, cache: CacheSegment | None) -> str:
    """NOTE [ A fleet ]: what decides a feed's samples beyond its data, seed, transform and fields,
    as ``KEY=VALUE`` words: which files are refused (``--max-pixels``, ``--max-file-bytes``), and
    for the built-in transforms the resize filter and whether large crops are DCT-scaled while
    decoding (the region decoder, unless a cache of decoded images needs full-decode pixels). The
    region decoder without DCT scaling gives a full decode's pixels, so it is not named."""
    words: dict[str, object] = {"max-pixels": config.max_pixels, "max-file-bytes": config.max_file_bytes}
    if not config.pipeline:
        words["interpolation"] = config.interpolation
        decoded_cache = cache is not None and cache.spec.kind is CacheKind.DECODED
        scaled = config.roi and config.augment != "none" and not decoded_cache
        words["dct-scaling"] = "on" if scaled else "off"
    return " ".join(f"{key}={value}" for key, value in words.items())


def _cache(config: FeedConfig, samples: int, workers: int, folder: Path) -> CacheSegment | None:
    """The feed's sample cache, 0600 whatever ``--group`` says: no trainer maps it, and what it holds
    is served to every later epoch (NOTE [ Sample cache ])."""
    if not config.cache_memory:
        return None
    kind = cache_kind(config.augment, config.pipeline, config.pipeline_deterministic)
    name = new_segment_name(f"{config.name}-cache")
    lock = folder / LOCK_NAME
    try:
        cache = CacheSegment.create(name, config.cache_memory, samples, workers, kind, lock)
    except CacheTooSmall as exc:
        raise ConfigError(f"feed {config.name}: {exc}") from None
    log.info(
        "feed %s: sample cache of %.1f MiB keeps %s (%s)%s",
        config.name,
        config.cache_memory / 2**20,
        kind.keeps,
        cache.spec.segment,
        "; train crops decode without DCT scaling, so every epoch has a full decode's pixels"
        if kind is CacheKind.DECODED and not config.pipeline
        else "",
    )
    return cache


def batch_layout(config: FeedConfig, index_dir: Path, probe_timeout: float) -> SlotLayout:
    """The built-in transforms' image and label, or what the pipeline returns for sample 0.

    A stated ``[fields]`` table is checked against that return, so a pipeline edited to give other
    fields stops the start instead of filling every batch with bad samples.
    """
    if not config.pipeline:
        return SlotLayout(config.batch_size, image_fields(config.image_size), encoded_room(config))
    log.info("feed %s: running pipeline %s on sample 0 to learn its fields", config.name, config.pipeline)
    timeout = probe_timeout + PROBE_START_ALLOWANCE
    found = probe_fields(
        config.pipeline,
        index_dir,
        config.seed,
        config.max_file_bytes,
        timeout,
        deterministic=config.pipeline_deterministic,
        storage=config.storage,
    )
    if config.fields and config.fields != found:
        raise PipelineError(
            f"feed {config.name}: pipeline {config.pipeline} returns "
            f"{describe_fields(found)} for sample 0, but the config file states "
            f"{describe_fields(config.fields)}"
        )
    try:
        layout = SlotLayout(config.batch_size, found)
    except ValueError as exc:  # too many fields, or a slot too large to allocate
        raise PipelineError(f"feed {config.name}: pipeline {config.pipeline}: {exc}") from None
    log.info("feed %s: batch fields %s", config.name, describe_fields(layout.fields))
    return layout


def encoded_room(config: FeedConfig) -> int:
    """Bytes a row of room for encoded rows (NOTE [ Encoded rows ]): what ``--encoded-row-bytes``
    says, its auto where the built-in train or eval transform runs with the region decoder (the one
    path whose crops a row can carry), and 0 wherever no row could go encoded."""
    if config.pipeline or not config.roi or config.augment not in ("train", "eval"):
        return 0
    if config.encoded_row_bytes >= 0:
        return config.encoded_row_bytes
    return max(3 * config.image_size**2, AUTO_ENCODED_ROW_BYTES)


def _indexing(config: FeedConfig, source: str) -> Callable[[int], None]:
    """How indexing a feed's source reports its progress."""
    what = f"feed {config.name}" + (f", source {source}" if config.sources else "")
    return lambda n: log.info("%s: indexing, %d samples", what, n)
