"""Warm start: the first batches of a feed's default plan, decoded while the service is idle.

NOTE [ Warm start ]
    A trainer that attaches and starts epoch 0 at position 0 as rank 0 of 1 (every single-trainer
    job's first epoch) would otherwise wait for its first batch to be decoded. While the workers have
    nothing else to do, the service decodes the first ``WARM_BATCHES`` batches of exactly that plan
    into ordinary slots (FILLING -> READY, NOTE [ Slot lifecycle ]). A session whose start matches
    takes the ready prefix into its own stream, where they are announced like any other batch; the
    cache then refills. Warm batches are the lowest priority: they are decoded only when no trainer
    wants a batch, and dropped (their slots freed) when a trainer needs a slot and the pool is full.
    The plan is the same pure function of (seed, epoch, rank, world_size) as every other, so what a
    trainer receives does not depend on whether it came from the cache.
    The same mechanism keeps a shard trainer fed across epoch boundaries: once its stream has decoded
    the whole epoch and has credit left, it decodes the first batches of the next epoch ahead, and a
    start of exactly that epoch at position 0 takes them. Any other start drops them.
    A start takes the batches still being decoded too (``take``): their tasks keep the cache's lane
    and old generation, and the cache forwards their completions to the stream that took them,
    which counts them as filling. Dropping them instead would throw away work at
    every epoch boundary, just when the trainer is about to wait for exactly those batches.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from loader_service.dataset.sampler import batch_of
from loader_service.supervisor.feeds import Feed

log = logging.getLogger(__name__)
GENERATIONS = itertools.count(1)
"""Plan generations for streams and caches alike: unique in the process, so a completion tagged with
one can never be taken for another plan's, whichever stream or cache it reaches."""
WARM_BATCHES = 2
WARM_PLAN = (0, 0, 1, "pad")
"""(epoch, rank, world_size, remainder) of the plan kept warm."""


class Filler(Protocol):
    """What takes over a cache's batches: a shard ``Stream``."""

    gen: int

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool: ...


@dataclass
class Handover:
    """What a start takes from a cache: decoded batches and the ones still being decoded."""

    ready: list[tuple[int, int, int]] = field(default_factory=list)
    """(seq, slot, count)"""
    filling: list[int] = field(default_factory=list)
    """seqs whose tasks have not reported yet"""


@dataclass
class _Forward:
    target: Filler
    target_gen: int
    remaining: int


class WarmCache:
    """The first ``batches`` batches of one plan, decoded before anyone asked for them.

    Used for the feed's warm start (``WARM_PLAN``) and, per shard stream, for the first batches of
    the next epoch while the trainer finishes the current one (NOTE [ Warm start ]).
    """

    def __init__(
        self,
        feed: Feed,
        batches: int = WARM_BATCHES,
        plan: tuple[int, int, int, str] = WARM_PLAN,
        key: tuple[object, ...] | None = None,
    ) -> None:
        self.feed = feed
        self.key = key or ("warm", feed.id)
        self._limit = batches
        self.gen = next(GENERATIONS)
        self.next_produce = 0
        self.filling = 0
        self.ready: dict[int, tuple[int, int]] = {}
        """seq -> (slot, count) of decoded batches waiting for a taker."""
        self._forwards: dict[int, _Forward] = {}
        """Old generation -> the stream its in-flight batches were handed to."""
        self._plan: npt.NDArray[np.int64] | None = None
        self.retarget(plan)

    def retarget(self, plan: tuple[int, int, int, str]) -> list[int]:
        """Keep another plan warm; return the slots of the old one's batches to free.

        The generation only grows, so a late batch of any earlier plan is never taken for this one.
        """
        epoch, _rank, world_size, remainder = plan
        self.plan_key = plan
        self.epoch = epoch
        self._plan = None  # computed when the first batch is decoded: most plans never are
        self._end = min(self._limit, self.feed.shard_batches(world_size, remainder))
        return self.drop()

    def serves(self, epoch: int, rank: int, world_size: int, remainder: str, position: int) -> bool:
        """Are this cache's batches the first ones of that start?"""
        return position == 0 and (epoch, rank, world_size, remainder) == self.plan_key

    def wants_batch(self) -> bool:
        return self.next_produce < self._end

    def plan_batch(self) -> tuple[int, int, npt.NDArray[np.int64]]:
        if self._plan is None:
            self._plan = self.feed.plan(*self.plan_key)
        seq = self.next_produce
        self.next_produce += 1
        self.filling += 1
        return self.gen, seq, batch_of(self._plan, seq, self.feed.config.batch_size)

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """Keep (or forward) a decoded batch; False if nobody wants it any more (free the slot)."""
        if gen != self.gen:
            return self._forward_filled(gen, seq, slot, count)
        self.filling -= 1
        self.ready[seq] = (slot, count)
        log.debug(
            "warm start: batch %d of epoch %d of feed %r ready (%s)",
            seq,
            self.epoch,
            self.feed.name,
            self.key[0],
        )
        return True

    def take(self, taker: Filler) -> Handover:
        """Everything planned so far, for ``taker`` at its current generation; the cache is then empty.

        Decoded batches are handed over at once; completions of those still being decoded are
        forwarded to ``taker`` as they arrive.
        """
        handover = Handover(sorted((seq, *v) for seq, v in self.ready.items()))
        handover.filling = [seq for seq in range(self.next_produce) if seq not in self.ready]
        if handover.filling:
            self._forwards[self.gen] = _Forward(taker, taker.gen, len(handover.filling))
        self.ready.clear()
        self.drop()
        return handover

    def forward_target(self, gen: int) -> Filler | None:
        """Who gets a completion of generation ``gen``: None for this cache itself or nobody."""
        forward = self._forwards.get(gen) if gen != self.gen else None
        return None if forward is None else forward.target

    def _forward_filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        forward = self._forwards.get(gen)
        if forward is None:
            return False
        forward.remaining -= 1
        if forward.remaining <= 0:
            del self._forwards[gen]
        return forward.target.filled(forward.target_gen, seq, slot, count)

    def drop(self) -> list[int]:
        """Empty the cache; batches still being decoded are freed when they report (new generation)."""
        freed = [slot for slot, _count in self.ready.values()]
        self.ready.clear()
        self.gen = next(GENERATIONS)
        self.next_produce = 0
        self.filling = 0
        return freed

    @property
    def held(self) -> int:
        """Slots this cache holds or is filling."""
        return self.filling + len(self.ready)
