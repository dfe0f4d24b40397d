"""What every batch producer shares: one plan of one feed, decoded batch by batch into the feed's slots.

A producer is a shard or broadcast ``Stream`` (batches trainers asked for) or a ``EarlyBatches`` (batches
decoded before anyone asked). The scheduler asks a producer for its next batch (``plan_batch``), hands
the task the producer itself, and gives the worker's report back to it (``complete``). A producer
frees the slots it no longer needs itself, so no caller ever holds a bare list of slots to free.

NOTE [ Plan generations ]
    Every (re)start of a plan takes a new generation from one process-wide counter, and every task
    carries the generation it was planned under. A completion whose generation is not the
    producer's current one belongs to an abandoned plan: its slot is freed, never delivered. Because
    the counter is shared by streams and early batches, a completion can never be taken for another
    producer's plan, even one recreated under the same name.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable

import numpy as np
import numpy.typing as npt

from loader_service.dataset.mixture import Mixture, MixtureEpoch
from loader_service.dataset.sampler import ShardOrder
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.choosing import Choice

GENERATIONS = itertools.count(1)
CHOICE_WAIT = 0.005
"""Seconds the main loop waits for an epoch it has just asked to be chosen, where the chooser takes
it at once: an epoch of up to about half a million positions is chosen in that time (C), and is
planned from at once instead of at the next tick; a longer one, or one queued behind others, is
planned from when it is there (NOTE [ Choosing off the main loop ])."""


class Lane(enum.Enum):
    """What a producer decodes for, as status and the log count its batches."""

    STREAM = "stream"
    """Batches a trainer's stream asked for."""
    AHEAD = "ahead"
    """The next epoch's first batches of a shard stream, while its trainer ends the current one."""
    WARM = "warm"
    """The feed's warm start: the first batches of its default plan, while the service is idle."""


PlanKey = tuple[int, int, int, str, int]
"""(epoch, rank, world_size, remainder, offset): a plan is a pure function of these and the feed's
seed (offset: where a resumed epoch's shared-out part begins, NOTE [ Elastic epochs ])."""


class Producer:
    """One plan's batches, planned in order; subclasses decide what a decoded batch is for."""

    lane = Lane.STREAM
    mixture: Mixture | None = None
    """The weights its trainer chose over the feed's sources (NOTE [ Mixture order ]); None: the
    feed's own order."""

    def encode_share(self) -> int:
        """Thousandths of each batch's rows to leave encoded for the trainer (NOTE [ Encoded rows ]):
        none for batches nobody has asked for yet."""
        return 0

    @property
    def epoch_samples(self) -> int:
        """Samples in one epoch of its mixture; 0: the feed's size."""
        return self.mixture.epoch_samples if self.mixture is not None else 0

    def __init__(self, feed: Feed, plan_key: PlanKey, requester: Hashable = None) -> None:
        self.feed = feed
        self.requester: Hashable = self if requester is None else requester
        """Whom its epochs are chosen for: the queue it waits in (NOTE [ Choosing off the main
        loop ]); a stream's ahead waits in its stream's."""
        self.gen = next(GENERATIONS)
        self.plan_key = plan_key
        self.next_produce = 0
        """Seq of the next batch to plan."""
        self.filling = 0
        """Batches planned and not yet reported by their worker."""
        self._order: ShardOrder | None = None
        """Made when the first batch is planned; holds keys, not samples (NOTE [ Epoch order without a
        permutation ] in loader_service.dataset.sampler)."""
        self._choice: Choice | None = None
        """A weighted plan's epoch, chosen on a thread (NOTE [ Choosing off the main loop ])."""

    @property
    def epoch(self) -> int:
        return self.plan_key[0]

    def restart(self, plan_key: PlanKey, position: int = 0) -> None:
        """Switch to a plan under a new generation (NOTE [ Plan generations ]), nothing in flight."""
        self.gen = next(GENERATIONS)
        self.plan_key = plan_key
        self._order = None  # computed when the first batch is planned: many plans never are
        self._forget_stale_choice()
        self.next_produce = position
        self.filling = 0

    def order_ready(self) -> bool:
        """Whether the plan's next batch can be planned now: a weighted plan's epoch is chosen on a
        thread first, asked for here (NOTE [ Choosing off the main loop ])."""
        if self._order is not None or self.mixture is None:
            return True
        self._forget_stale_choice()
        if self._choice is None:
            self._choice = Choice(self.mixture, self.epoch, self.requester)
            return self._choice.wait(CHOICE_WAIT if self._choice.next_up else 0.0)
        return self._choice.done()

    def _forget_stale_choice(self) -> None:
        """Cancel a request for another plan's epoch or weights, and drop one cancelled meanwhile."""
        choice = self._choice
        if choice is not None and (not choice.of(self.mixture, self.epoch) or choice.cancelled()):
            choice.cancel()
            self._choice = None

    def forget_choice(self) -> None:
        """Cancel its request, whatever it is for: nobody will plan from it (a stream closed)."""
        if self._choice is not None:
            self._choice.cancel()
            self._choice = None

    def share_choice(self, other: Producer) -> None:
        """Take ``other``'s request over where it is for this plan's epoch and weights (a stream
        taking the batches decoded ahead for it): handed over, not shared, so that ``other``
        moving on to another plan cannot cancel it."""
        if self._choice is None and other._choice is not None and other._choice.of(self.mixture, self.epoch):
            self._choice, other._choice = other._choice, None

    @property
    def chosen(self) -> MixtureEpoch | None:
        """The weighted plan's epoch, once chosen; None before, or without weights."""
        choice = self._choice
        if (
            choice is None
            or self.mixture is None
            or not choice.of(self.mixture, self.epoch)
            or not choice.done()
        ):
            return None
        return choice.result()

    def plan_batch(self) -> tuple[int, int, npt.NDArray[np.int64]]:
        """(generation, seq, sample indices) of the next batch to decode: only once ``order_ready``
        (a weighted plan asked otherwise would choose its epoch here, in the main loop)."""
        if self._order is None:
            chosen = self.chosen
            if self.mixture is not None and chosen is None:
                chosen = self.mixture.epoch(self.epoch)
            self._order = self.feed.plan(*self.plan_key, order=chosen)
        seq = self.next_seq()
        self.filling += 1
        return self.gen, seq, self._order.batch(seq, self.feed.config.batch_size)

    def next_seq(self) -> int:
        """The seq to plan next: the plan's next one in order (a picked stream overrides this)."""
        seq = self.next_produce
        self.next_produce += 1
        return seq

    def complete(self, gen: int, seq: int, slot: int, count: int) -> Producer | None:
        """A worker filled ``slot`` for batch (gen, seq): keep it or free it (NOTE [ Slot lifecycle ]).

        Returns the producer (a stream) whose members may now be sent something, if any.
        """
        receiver = self.receiver(gen)
        if not self.filled(gen, seq, slot, count):
            self.feed.pool.release(slot)  # its plan was abandoned while the slot was filling
            return None
        self.feed.counters.batches += 1
        self.feed.pool.filled(slot)
        return receiver

    def free(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.feed.pool.release(slot)

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """Record a decoded batch; False if nobody wants it any more."""
        raise NotImplementedError

    def receiver(self, gen: int) -> Producer | None:
        """The producer (a stream) a completion of generation ``gen`` may be delivered from."""
        raise NotImplementedError
