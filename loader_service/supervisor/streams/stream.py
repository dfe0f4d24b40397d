"""Streams: who gets which batch. A stream produces one epoch plan and delivers it to its members.

Two kinds, chosen once, when a stream's first member attaches (``attachments.make_stream``):

* ``ShardStream`` (shard.py): one per trainer, planned from (seed, epoch, rank, world_size,
  remainder). A ``start`` at any epoch and position restarts it there (set_epoch, resume, breaking
  out of a loop). A fleet's trainer picks the batches it decodes (NOTE [ Kept batches ]).
* ``BroadcastStream`` (broadcast.py): one per (feed, group), every member receiving every batch;
  each batch is decoded once and its slot is freed when every member has released it (or left)
  (NOTE [ Broadcast epochs ]).

This module holds what both share: members, the batches decoded and who still needs each, and
delivery in plan order. Every batch is keyed by (generation, seq); the generation changes with
every (re)start of a plan, so slots of an abandoned plan are never delivered, and are freed when
their last holder lets go.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from loader_service.dataset.mixture import Mixture
from loader_service.dataset.tables import DatasetError
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.early import EarlyBatches, Handover
from loader_service.supervisor.streams.producers import Producer
from loader_service.supervisor.trainers.sessions import Session
from protocol.shares import consumed

BatchKey = tuple[int, int]


@dataclass
class SharedBatch:
    slot: int
    count: int
    pending: set[str]
    """Members that should still receive this batch."""
    holders: set[str] = field(default_factory=set)
    """Members holding a lease on it."""

    @property
    def finished(self) -> bool:
        return not self.pending and not self.holders


@dataclass
class Member:
    session: Session
    since: float = field(default_factory=time.monotonic)
    """When it joined the stream."""
    want: tuple[int, int] | None = None
    """(epoch, position) asked by the latest start that has not begun yet."""
    active: bool = False
    next_send: int = 0
    end_sent: bool = True


class StartRefused(ValueError):
    """A start that a stream cannot honour; the message goes to the trainer."""


class Stream(Producer):
    """The batches of one plan and who has received which; a kind of stream says how starts are
    applied. Every method that makes a batch unneeded frees its slot itself (NOTE [ Slot lifecycle ])."""

    def __init__(
        self, key: tuple[object, ...], feed: Feed, session: Session, mixture: Mixture | None
    ) -> None:
        self.rank, self.world_size, self.remainder = session.rank, session.world_size, session.remainder
        super().__init__(feed, (-1, self.rank, self.world_size, self.remainder, 0), key)
        self.key = key
        self.mixture = mixture
        self.started = False
        """Whether an epoch has begun."""
        self.group, self.group_size = session.group, session.group_size
        self.members: dict[str, Member] = {}
        self.evicted: set[str] = set()
        """Members removed for lag that still hold leases: their slots stay theirs until released."""
        self.end = 0
        self.batches: dict[BatchKey, SharedBatch] = {}
        self.ahead: EarlyBatches | None = None
        """The next epoch's first batches, decoded early where the kind does (NOTE [ Warm start ])."""

    def encode_share(self) -> int:
        """The share its trainer asked for (NOTE [ Encoded rows ]). A broadcast group's batches are
        decoded by the service whatever its members ask: one decode there serves every member,
        where encoded rows would be decoded once by each."""
        if self.group_size > 1 or len(self.members) != 1:
            return 0
        return next(iter(self.members.values())).session.encode

    def front(self) -> tuple[int, npt.NDArray[np.int64] | None]:
        """The planning front (NOTE [ Source ledger ]): where the whole job's next planned batch
        begins in its epoch's order (its ranks move in step), and each source's draws before it in
        the run; draws None without a mixture, or before its epoch is chosen (NOTE [ Choosing off
        the main loop ]), and the position 0 without a mixture."""
        if self.mixture is None:
            return 0, None
        _epoch, _rank, world, _remainder, offset = self.plan_key
        n = self.mixture.epoch_samples
        position = consumed(offset, self.planned_batches(), self.feed.config.batch_size, world, n)
        order = self.chosen
        return position, None if order is None else order.drawn_before(min(position, n))

    def planned_batches(self) -> int:
        """Batches of the epoch's plan before its planning front (a picked run plans out of order:
        the front is past the highest it planned)."""
        return self.next_produce

    # --- membership -----------------------------------------------------------------------------

    def add(self, session: Session) -> None:
        self.members[session.session_id] = Member(session)

    def evict(self, session_id: str) -> None:
        """Stop delivering to a member but leave it the batches it holds; free slots now unneeded."""
        self.members.pop(session_id, None)
        self.evicted.add(session_id)
        for batch in self.batches.values():
            batch.pending.discard(session_id)
        self._collect()

    def remove(self, session_id: str) -> None:
        """Forget a member; free the slots that no one needs any more."""
        self.members.pop(session_id, None)
        self.evicted.discard(session_id)
        for batch in self.batches.values():
            batch.pending.discard(session_id)
            batch.holders.discard(session_id)
        self._collect()

    @property
    def window(self) -> int:
        return min((m.session.credits for m in self.members.values()), default=0)

    @property
    def picked(self) -> bool:
        """Whether the trainer names the batches this run decodes (a shard stream's picked run)."""
        return False

    @property
    def in_flight(self) -> int:
        """Batches counted against the window; those held only by evicted members no longer are."""
        return self._asked_in_flight()

    def _asked_in_flight(self) -> int:
        live = sum(1 for b in self.batches.values() if b.pending or b.holders - self.evicted)
        return self.filling + live

    def wants_ahead(self) -> bool:
        """Whether to decode the next epoch's first batches now (``ahead``)."""
        return False

    def batches_per_epoch(self, offset: int = 0) -> int:
        return self.feed.shard_batches(self.world_size, self.remainder, offset, self.epoch_samples)

    # --- starting epochs ------------------------------------------------------------------------

    def reweight(self, changes: tuple[tuple[int, tuple[float, ...]], ...]) -> None:
        """A start's weight changes (NOTE [ Weight changes ] in gpu_worker/weighting.py): the plans
        from now on follow them, and the next epoch's batches decoded ahead with other weights are
        dropped. StartRefused naming what is wrong with them."""
        if self.mixture is None:
            if changes:
                raise StartRefused("weight changes need weights: this trainer attached without them")
            return
        try:
            mixture = self.mixture.changed(changes, self.feed.sources.names)
        except DatasetError as exc:
            raise StartRefused(str(exc)) from None
        if mixture != self.mixture:
            self.mixture = mixture
            if self.ahead is not None:
                self.ahead.mixture = mixture
                self.ahead.drop()

    def on_start(
        self,
        session_id: str,
        epoch: int,
        position: int,
        warm: EarlyBatches | None = None,
        picked: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None:
        """Apply a member's start, freeing the slots of an abandoned plan. May raise StartRefused.

        ``warm``: the feed's warm-start batches, which a shard start may take from (NOTE [ Warm start ]).
        ``picked``: the seqs a picked start asks for first (None: not picked).
        ``offset``: shard mode: where the epoch's shared-out part begins (NOTE [ Elastic epochs ]).
        """
        raise NotImplementedError

    def on_member_left(self) -> None:
        """A departed member may have been the last one in the epoch, or the last one another was
        waiting for."""
        if self.started and not any(m.active or m.want is not None for m in self.members.values()):
            self._abandon_epoch()
        else:
            self._members_changed()

    def _members_changed(self) -> None:
        """Membership changed while the epoch goes on (a kind that waits for members begins it)."""

    def _abandon_epoch(self) -> None:
        """Nobody is in the epoch or waiting for the next one: the members left (if any) attached
        but have not started. The epoch has no "where it is" for them to join: without this, its
        rest would be decoded for nobody, and a member that started next would join at its end and
        get nothing (NOTE [ Broadcast epochs ]). Slots evicted members hold stay theirs."""
        for batch in self.batches.values():
            batch.pending.clear()
        self._collect()
        self.restart(self.plan_key)  # a new generation: batches still decoding are refused
        self.started = False

    def _activate(self, member: Member, position: int) -> None:
        member.want, member.active = None, True
        member.next_send, member.end_sent = min(position, self.end), False

    def _begin(self, epoch: int, position: int, offset: int = 0) -> None:
        """Switch to a new plan (NOTE [ Plan generations ]); the old one's undelivered batches are dropped."""
        self.end = self.batches_per_epoch(offset)
        self.restart((epoch, self.rank, self.world_size, self.remainder, offset), min(position, self.end))
        self.started = True
        for batch in self.batches.values():
            batch.pending.clear()
        self._collect()

    def close(self) -> None:
        """The last member left: free every batch; those still decoding are freed when they report.
        Its epochs wanted of the chooser are no longer (NOTE [ Choosing off the main loop ])."""
        self.free(batch.slot for batch in self.batches.values())
        self.batches.clear()
        if self.ahead is not None:
            self.ahead.drop()
            self.ahead.forget_choice()
        self.restart(self.plan_key)
        self.forget_choice()
        self.started = False

    # --- production -----------------------------------------------------------------------------

    def wants_batch(self) -> bool:
        return (
            self.started
            and self.next_produce < self.end
            and self.in_flight < self.window
            and self.order_ready()
        )

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """Record a decoded batch; False if its plan was abandoned meanwhile, or nobody needs it."""
        if gen != self.gen:
            return False
        self.filling -= 1
        active = {sid for sid, m in self.members.items() if m.active and m.next_send <= seq}
        if not active:
            return False
        self.batches[(gen, seq)] = SharedBatch(slot, count, active)
        return True

    def receiver(self, gen: int) -> Producer | None:
        return self

    def adopt(self, handover: Handover) -> None:
        """Take early batches of this plan, decoded and in flight (NOTE [ Warm start ])."""
        for seq, slot, count in handover.ready:
            self.batches[(self.gen, seq)] = SharedBatch(slot, count, self._active_ids())
        self.filling += len(handover.filling)
        planned = [seq for seq, _slot, _count in handover.ready] + handover.filling
        self.next_produce = max(self.next_produce, max(planned, default=-1) + 1)

    def _active_ids(self) -> set[str]:
        """The members in the epoch: those a batch of it is due to."""
        return {sid for sid, m in self.members.items() if m.active}

    # --- delivery -------------------------------------------------------------------------------

    def deliverable(self, member: Member) -> Iterator[tuple[BatchKey, SharedBatch]]:
        """Batches ``member`` may be sent now, in order, within its credits."""
        sid = member.session.session_id
        while member.active and len(member.session.leases) < member.session.credits:
            key = (self.gen, member.next_send)
            batch = self.batches.get(key)
            if batch is None:
                return
            batch.pending.discard(sid)
            batch.holders.add(sid)
            member.next_send += 1
            yield key, batch

    def undeliver(self, member: Member, key: BatchKey) -> None:
        """Take back a batch whose announcement could not be sent: it is due to the member again."""
        sid = member.session.session_id
        batch = self.batches[key]
        batch.holders.discard(sid)
        batch.pending.add(sid)
        if not self.picked:  # a picked run announces what is ready in the order asked, not by position
            member.next_send = key[1]

    def release(self, session_id: str, key: BatchKey) -> None:
        """A member let go of a batch; its slot is freed if nobody needs it any more."""
        batch = self.batches.get(key)
        if batch is None:
            return
        batch.holders.discard(session_id)
        if batch.finished:
            del self.batches[key]
            self.feed.pool.release(batch.slot)
            self._forget(key)

    def _forget(self, key: BatchKey) -> None:
        """A batch every member let go of is gone (a kind that tracks what was asked for forgets it)."""

    def _collect(self) -> None:
        done = [key for key, batch in self.batches.items() if batch.finished]
        self.free(self.batches.pop(key).slot for key in done)
        for key in done:
            self._forget(key)

    # --- members that hold others up ------------------------------------------------------------

    def to_evict(self, now: float, patience: float) -> list[tuple[str, str]]:
        """Members that have held the others up for longer than ``patience``, each with how, to be
        evicted (a kind whose members wait for each other has them: NOTE [ Broadcast epochs ])."""
        return []
