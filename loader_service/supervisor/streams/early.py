"""Warm start: the first batches of a feed's default plan, decoded while the service is idle.

NOTE [ Warm start ]
    A trainer that attaches and starts epoch 0 at position 0 as rank 0 of 1 (every single-trainer
    job's first epoch) would otherwise wait for its first batch to be decoded. While the workers have
    nothing else to do, the service decodes the first ``WARM_BATCHES`` batches of exactly that plan
    into ordinary slots (FILLING -> READY, NOTE [ Slot lifecycle ]). A session whose start matches
    takes the ready prefix into its own stream, where they are announced like any other batch; the
    warm start then decodes them again. Warm batches are the lowest priority: they are decoded only
    when no trainer wants a batch, and dropped (their slots freed) when a trainer needs a slot and
    the pool is full.
    The plan is the same pure function of (seed, epoch, rank, world_size) as every other, so what a
    trainer receives does not depend on whether it was decoded early.
    The same mechanism keeps a shard trainer fed across epoch boundaries: once its stream has decoded
    the whole epoch and has credit left, it decodes the first batches of the next epoch ahead, and a
    start of exactly that epoch at position 0 takes them. Any other start drops them.
    A start takes the batches still being decoded too (``take``): their tasks keep the early
    batches' lane and old generation, which forward their completions to the stream that took them,
    which counts them as filling. Dropping them instead would throw away work at
    every epoch boundary, just when the trainer is about to wait for exactly those batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from loader_service.dataset.mixture import Mixture
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.producers import Lane, PlanKey, Producer

log = logging.getLogger(__name__)
WARM_BATCHES = 2
WARM_PLAN: PlanKey = (0, 0, 1, "pad", 0)
"""(epoch, rank, world_size, remainder, offset) of the plan kept warm."""


@dataclass
class Handover:
    """What a start takes from early batches: decoded batches and the ones still being decoded."""

    ready: list[tuple[int, int, int]] = field(default_factory=list)
    """(seq, slot, count)"""
    filling: list[int] = field(default_factory=list)
    """seqs whose tasks have not reported yet"""


@dataclass
class _Forward:
    target: Producer
    target_gen: int
    remaining: int


class EarlyBatches(Producer):
    """The first ``batches`` batches of one plan, decoded before anyone asked for them.

    Used for the feed's warm start (``WARM_PLAN``, ``Lane.WARM``) and, per shard stream, for the
    first batches of the next epoch while the trainer finishes the current one (``Lane.AHEAD``,
    NOTE [ Warm start ]), whose epochs are chosen in its stream's queue (``requester``).
    """

    def __init__(
        self,
        feed: Feed,
        batches: int = WARM_BATCHES,
        plan: PlanKey = WARM_PLAN,
        lane: Lane = Lane.WARM,
        mixture: Mixture | None = None,
        requester: Hashable = None,
        share: Callable[[], int] = lambda: 0,
    ) -> None:
        """``share``: thousandths of each batch to leave encoded (NOTE [ Encoded rows ]): a stream's
        next epoch's first batches are its trainer's, so they follow its share; the warm start's
        have no trainer yet, and the service decodes them."""
        super().__init__(feed, plan, requester)
        self._share = share
        self.lane = lane
        self.mixture = mixture
        self._limit = batches
        self.ready: dict[int, tuple[int, int]] = {}
        """seq -> (slot, count) of decoded batches waiting for a taker."""
        self._forwards: dict[int, _Forward] = {}
        """Old generation -> the stream its in-flight batches were handed to."""
        self.retarget(plan)

    def encode_share(self) -> int:
        return self._share()

    def retarget(self, plan: PlanKey) -> None:
        """Keep another plan warm; the old one's decoded batches are freed.

        The generation only grows, so a late batch of any earlier plan is never taken for this one.
        """
        _epoch, _rank, world_size, remainder, offset = plan
        self._end = min(
            self._limit, self.feed.shard_batches(world_size, remainder, offset, self.epoch_samples)
        )
        self.drop(plan)

    def serves(self, plan: PlanKey, position: int) -> bool:
        """Are these early batches the first ones of that start?"""
        return position == 0 and plan == self.plan_key

    def wants_batch(self) -> bool:
        return self.next_produce < self._end and self.order_ready()

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """Keep (or forward) a decoded batch; False if nobody wants it any more."""
        if gen != self.gen:
            return self._forward_filled(gen, seq, slot, count)
        self.filling -= 1
        self.ready[seq] = (slot, count)
        log.debug(
            "warm start: batch %d of epoch %d of feed %r ready (%s)",
            seq,
            self.epoch,
            self.feed.name,
            self.lane.value,
        )
        return True

    def receiver(self, gen: int) -> Producer | None:
        """The stream these early batches of generation ``gen`` were handed to, if any."""
        forward = self._forwards.get(gen) if gen != self.gen else None
        return None if forward is None else forward.target

    def take(self, taker: Producer) -> Handover:
        """Everything planned so far, for ``taker`` at its current generation; none are left then.

        Decoded batches are handed over at once; completions of those still being decoded are
        forwarded to ``taker`` as they arrive.
        """
        handover = Handover(sorted((seq, *v) for seq, v in self.ready.items()))
        handover.filling = [seq for seq in range(self.next_produce) if seq not in self.ready]
        if handover.filling:
            self._forwards[self.gen] = _Forward(taker, taker.gen, len(handover.filling))
        self.ready.clear()  # handed over, so the drop below must not free them
        self.drop()
        return handover

    def _forward_filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        forward = self._forwards.get(gen)
        if forward is None:
            return False
        forward.remaining -= 1
        if forward.remaining <= 0:
            del self._forwards[gen]
        return forward.target.filled(forward.target_gen, seq, slot, count)

    def drop(self, plan: PlanKey | None = None) -> None:
        """Drop these early batches and free the decoded ones (then keep ``plan`` warm, if given); those
        still being decoded are freed when they report, since they now carry an old generation."""
        self.free(slot for slot, _count in self.ready.values())
        self.ready.clear()
        self.restart(plan or self.plan_key)

    @property
    def held(self) -> int:
        """Slots these early batches hold or are filling."""
        return self.filling + len(self.ready)
