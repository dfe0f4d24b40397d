"""Streams: who gets which batch. A stream produces one epoch plan and delivers it to its members.

* Shard mode: one stream per trainer, planned from (seed, epoch, rank, world_size, remainder). A
  ``start`` at any epoch and position restarts it there (set_epoch, resume, breaking out of a loop).
* Broadcast mode: one stream per (feed, group), with every member receiving every batch; each batch
  is decoded once and its slot is freed when every member has released it (or left).

NOTE [ Broadcast epochs ]
    The group's first epoch begins when ``group_size`` members have started it (they must agree on
    the epoch; if their positions differ, as after a service restart, the group decodes from the
    earliest and each member receives from its own, so each still sees each image once). Later
    epochs begin when every member has finished the current one and started the next: members
    iterate epochs together. A member that starts the epoch the group is
    already in (a late joiner, or one that rejoined after dying) receives it from the oldest batch
    still held, so it may miss the batches before that: exactly-once holds for members that stay.
    When the last member in the epoch leaves and none is waiting for the next, the epoch is
    abandoned and the group begins afresh with whoever starts next (``_abandon_epoch``).
    A member that holds the group up for longer than the lag timeout is evicted (trainers.py), and so
    is one that attached and never started while the others wait to begin: it gets no further
    batches, but keeps the slots of those it holds until it releases them, so a slow step never sees
    its batch overwritten. A dead member is dropped after its heartbeat timeout, and its
    slots with it. Either way the others never stall for longer than those timeouts.

* Picked shard mode (a fleet's trainer, NOTE [ A fleet ] in gpu_worker/fleet.py): the trainer names
  the batches of the plan this service decodes (``Start.want`` and ``want`` messages); nothing else
  is decoded for it, what is ready is announced in the order asked, and no ``end`` is sent.

Every batch is keyed by (generation, seq); the generation changes with every (re)start of a plan, so
slots of an abandoned plan are never delivered, and are freed when their last holder lets go.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.producers import Producer
from loader_service.supervisor.sessions import Session
from loader_service.supervisor.warm import Handover, WarmCache

BatchKey = tuple[int, int]
log = logging.getLogger(__name__)


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
    """A start that a broadcast group cannot honour; the message goes to the trainer."""


class Stream(Producer):
    """The batches of one shard trainer, or of one broadcast group, and who has received which.

    Every method that makes a batch unneeded frees its slot itself (NOTE [ Slot lifecycle ]).
    """

    def __init__(self, key: tuple[object, ...], feed: Feed, session: Session) -> None:
        self.rank, self.world_size, self.remainder = session.rank, session.world_size, session.remainder
        super().__init__(feed, (-1, self.rank, self.world_size, self.remainder, 0))
        self.key = key
        self.broadcast = session.mode == "broadcast"
        self.started = False
        """Whether an epoch has begun."""
        self.group, self.group_size = session.group, session.group_size
        self.members: dict[str, Member] = {}
        self.evicted: set[str] = set()
        """Members removed for lag that still hold leases: their slots stay theirs until released."""
        self.end = 0
        self.batches: dict[BatchKey, SharedBatch] = {}
        self.blocked_since: float | None = None
        self.waiting_since: float | None = None
        """Since when members have been waiting to begin an epoch that others have not started."""
        self.ahead: WarmCache | None = None
        """Shard mode: the next epoch's first batches, decoded early (NOTE [ Warm start ])."""
        self.picks: list[int] | None = None
        """Picked mode: seqs asked for and not yet planned, a heap: the lowest is decoded next, so a
        batch the trainer waits for, asked again of this service (a backup, NOTE [ A fleet ] in
        gpu_worker/fleet.py), goes before those asked ahead of it. None otherwise."""
        self.wanted: set[int] = set()
        """Picked mode: every seq of this plan the trainer asked for."""
        self.planned: set[int] = set()
        """Picked mode: seqs planned in this plan (decoding, decoded or delivered)."""
        self.last_asked = False
        """Picked mode: the trainer asked this service for the plan's last batch (the next epoch's
        first ones may then be decoded ahead)."""
        self.kept: dict[int, tuple[int, int]] = {}
        """Picked mode: seq -> (slot, count) of this plan's batches a cache decoded early that the
        trainer has not asked for yet (NOTE [ Kept batches ])."""

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
    def in_flight(self) -> int:
        """Batches counted against the window; those held only by evicted members no longer are.
        A picked run's trainer counts only what it asked for, so batches decoded ahead never keep
        one it asked for from being decoded (they give way, scheduler.py); other runs count them."""
        return self._asked_in_flight() + (self._ahead_held() if self.picks is None else 0)

    def _asked_in_flight(self) -> int:
        live = sum(1 for b in self.batches.values() if b.pending or b.holders - self.evicted)
        return self.filling + live

    def _ahead_held(self) -> int:
        return self.ahead.held if self.ahead is not None else 0

    def wants_ahead(self) -> bool:
        """Shard mode, epoch fully decoded, credit left: decode the next epoch's first batches."""
        if self.ahead is None or not self.started or not self._all_planned():
            return False
        return self._asked_in_flight() + self._ahead_held() < self.window and self.ahead.wants_batch()

    def _all_planned(self) -> bool:
        if self.picks is None:
            return self.next_produce >= self.end
        return not self.picks and self.last_asked

    def batches_per_epoch(self, offset: int = 0) -> int:
        return self.feed.shard_batches(self.world_size, self.remainder, offset)

    # --- starting epochs ------------------------------------------------------------------------

    def on_start(
        self,
        session_id: str,
        epoch: int,
        position: int,
        warm: WarmCache | None = None,
        picked: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None:
        """Apply a member's start, freeing the slots of an abandoned plan. May raise StartRefused.

        ``warm``: the feed's warm-start cache, which a shard start may take from (NOTE [ Warm start ]).
        ``picked``: the seqs a picked start asks for first (None: not picked).
        ``offset``: shard mode: where the epoch's shared-out part begins (NOTE [ Elastic epochs ]).
        """
        member = self.members[session_id]
        if not self.broadcast:
            if offset and not 0 < offset < len(self.feed.index):
                raise StartRefused(f"offset {offset} is outside the epoch's {len(self.feed.index)} samples")
            return self._start_shard(member, epoch, position, warm, picked, offset)
        if picked is not None:
            raise StartRefused("a broadcast group is fed by one service: a picked start is for shard mode")
        if offset:
            raise StartRefused("a broadcast group resumes by position, not at an offset")
        if self.started and epoch == self.epoch and not member.active:
            self._join_running(member)
            return
        if self.started and epoch == self.epoch:
            # A member that resumed its session (NOTE [ Reconnecting ]) asks for the epoch it is in:
            # it goes on from where the group is delivering to it, as a late joiner would; its end
            # of epoch is sent again in case the old connection lost it.
            member.end_sent = False
            return
        self._check_broadcast_start(member, epoch, position)
        member.active, member.want = False, (epoch, position)
        self._maybe_begin_group_epoch()

    def _start_shard(
        self,
        member: Member,
        epoch: int,
        position: int,
        warm: WarmCache | None,
        picked: tuple[int, ...] | None,
        offset: int,
    ) -> None:
        """(Re)start the plan; take batches decoded early (ahead, or warm) if they are its first ones."""
        plan = (epoch, self.rank, self.world_size, self.remainder, offset)
        cache = next((c for c in (self.ahead, warm) if c is not None and c.serves(plan, position)), None)
        self._begin(epoch, position, offset)
        self.picks, self.wanted, self.planned = (None if picked is None else []), set(), set()
        self.last_asked = False
        self._activate(member, 0 if picked is not None else position)
        if picked is not None:
            member.end_sent = True  # a picked run has no end: the trainer counts its batches
        if cache is not None:
            handover = cache.take(self)
            self.adopt(handover)
            if picked is not None:
                self._keep_picked(handover, picked)
            log.debug(
                "%s took %d batches of epoch %d from the %s cache, %d of them still decoding",
                self.key[1],
                len(handover.ready) + len(handover.filling),
                epoch,
                cache.lane,
                len(handover.filling),
            )
        following = (epoch + 1, self.rank, self.world_size, self.remainder, 0)
        if self.ahead is None:
            self.ahead = WarmCache(self.feed, self.window, following, lane="ahead")
        else:
            self.ahead.retarget(following)
        if picked is not None:
            self.want(picked, member.session.credits)

    def _keep_picked(self, handover: Handover, picked: tuple[int, ...]) -> None:
        """Picked mode: of what a cache handed over, keep the decoded batches the start did not ask
        for aside, not announced (NOTE [ Kept batches ]); those still decoding join them when they
        complete, unless asked for by then.

        NOTE [ Kept batches ]
            A picked start names only the batches the trainer hands this service at once (a few,
            by its pace: NOTE [ A fleet ] in gpu_worker/fleet.py), while the next epoch's first
            ``credits`` batches may already be decoded ahead. Freeing the rest would decode them
            again moments later, at every epoch's start (measured: a trainer with 40 credits got 9
            of 40 ready batches at once and waited on decoding for the other 31). So they are kept
            in their slots, and a later ``want`` of one announces it at once. They are the first
            thing to go when the pool has no free slot for a batch asked for (scheduler.py), and
            all go when the plan changes or the trainer leaves; in a fleet, where another service
            may be given them, that is all they cost.
        """
        first = set(picked)
        # Only this plan's: batches of earlier plans in ``batches`` are still held by the trainer.
        unwanted = [key for key in self.batches if key[0] == self.gen and key[1] not in first]
        for key in unwanted:
            batch = self.batches.pop(key)
            self.kept[key[1]] = (batch.slot, batch.count)
        self.planned = {key[1] for key in self.batches if key[0] == self.gen} | set(handover.filling)
        self.planned |= self.kept.keys()

    def drop_kept(self) -> bool:
        """Free the batches kept aside (NOTE [ Kept batches ]); whether there were any."""
        for seq in self.kept:
            self.planned.discard(seq)
        self.free(slot for slot, _count in self.kept.values())
        dropped = bool(self.kept)
        self.kept.clear()
        return dropped

    def want(self, seqs: tuple[int, ...], limit: int) -> None:
        """Picked mode: decode ``seqs`` of this plan too, keeping at most ``limit`` queued (the
        trainer names again what has not arrived); a seq asked for before, or past the epoch, is
        ignored."""
        if self.picks is None or not self.started:
            return
        for seq in seqs:
            if not 0 <= seq < self.end or seq in self.wanted:
                continue
            if seq in self.kept:  # NOTE [ Kept batches ]: decoded already, announced now
                self._announce_kept(seq)
            elif seq not in self.planned:  # else handed over by a cache, or still decoding there
                if len(self.picks) >= limit:
                    continue
                heapq.heappush(self.picks, seq)
                self.planned.add(seq)
            self.wanted.add(seq)
            self.last_asked = self.last_asked or seq == self.end - 1

    def _announce_kept(self, seq: int) -> None:
        slot, count = self.kept.pop(seq)
        self.batches[(self.gen, seq)] = SharedBatch(slot, count, self._active_ids())

    def _active_ids(self) -> set[str]:
        """The members in the epoch: those a batch of it is due to."""
        return {sid for sid, m in self.members.items() if m.active}

    def next_seq(self) -> int:
        if self.picks is None:
            return super().next_seq()
        return heapq.heappop(self.picks)

    def _check_broadcast_start(self, member: Member, epoch: int, position: int) -> None:
        others = {m.want[0] for m in self.members.values() if m.want is not None and m is not member}
        if others and others != {epoch}:
            raise StartRefused(
                f"broadcast group {self.group!r} members must start the same epoch: "
                f"others asked for {sorted(others)}, this trainer for {epoch}"
            )
        if self.started and epoch != self.epoch + 1:
            raise StartRefused(
                f"broadcast group {self.group!r} is in epoch {self.epoch}; its members iterate epochs "
                f"together, so the next one is {self.epoch + 1}, not {epoch}"
            )
        if self.started and position != 0:
            raise StartRefused("a broadcast group resumes at a position only before its first epoch")

    def _maybe_begin_group_epoch(self) -> None:
        waiting = [m for m in self.members.values() if m.want is not None]
        if not self.started and len(waiting) < self.group_size:
            return  # NOTE [ Broadcast epochs ]: the first epoch waits for group_size members
        if len(waiting) < len(self.members) or not waiting:
            return  # someone is still in the current epoch
        # Members may resume at different positions (after a service restart, each reconnects where
        # its loop was): the group starts at the earliest, and each member receives from its own.
        wants = [m.want for m in waiting if m.want is not None]
        epoch = wants[0][0]
        self._begin(epoch, min(position for _, position in wants))
        for m in waiting:
            assert m.want is not None
            self._activate(m, m.want[1])

    def on_member_left(self) -> None:
        """A departed member may have been the last one in the epoch, or the last one the next
        epoch was waiting for."""
        if self.started and not any(m.active or m.want is not None for m in self.members.values()):
            self._abandon_epoch()
        else:  # the group's first epoch too may have waited only for the one that left
            self._maybe_begin_group_epoch()

    def _abandon_epoch(self) -> None:
        """NOTE [ Broadcast epochs ]: nobody is in the group's epoch or waiting for the next one; the
        members left (if any) attached but have not started. The epoch has no "where it is" for them
        to join: without this, the group would decode the rest of it for nobody, and a member that
        started next would join at its end and get nothing. The group begins afresh at their start,
        as a new group would. Slots evicted members still hold stay theirs until released."""
        for batch in self.batches.values():
            batch.pending.clear()
        self._collect()
        self.restart(self.plan_key)  # a new generation: batches still decoding are refused
        self.started = False

    def _join_running(self, member: Member) -> None:
        current = [seq for gen, seq in self.batches if gen == self.gen]
        start = min(current, default=self.next_produce)
        self._activate(member, start)
        for (gen, seq), batch in self.batches.items():
            if gen == self.gen and seq >= start:
                batch.pending.add(member.session.session_id)

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
        self.drop_kept()

    def close(self) -> None:
        """The last member left: free every batch; those still decoding are freed when they report."""
        self.free(batch.slot for batch in self.batches.values())
        self.batches.clear()
        self.drop_kept()
        if self.ahead is not None:
            self.ahead.drop()
        self.restart(self.plan_key)
        self.started = False

    # --- production -----------------------------------------------------------------------------

    def wants_batch(self) -> bool:
        more = self.next_produce < self.end if self.picks is None else bool(self.picks)
        return self.started and more and self.in_flight < self.window

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """Record a decoded batch; False if its plan was abandoned meanwhile, or nobody asked for it
        (picked mode: a cache's batch still decoding when the start passed it over)."""
        if gen != self.gen:
            return False
        self.filling -= 1
        if self.picks is not None and seq not in self.wanted:
            self.kept[seq] = (slot, count)  # NOTE [ Kept batches ]
            return True
        active = {sid for sid, m in self.members.items() if m.active and m.next_send <= seq}
        if not active:
            return False
        self.batches[(gen, seq)] = SharedBatch(slot, count, active)
        return True

    def receiver(self, gen: int) -> Stream | None:
        return self

    def adopt(self, handover: Handover) -> None:
        """Take a cache's batches of this plan, decoded and in flight (NOTE [ Warm start ])."""
        for seq, slot, count in handover.ready:
            self.batches[(self.gen, seq)] = SharedBatch(slot, count, self._active_ids())
        self.filling += len(handover.filling)
        planned = [seq for seq, _slot, _count in handover.ready] + handover.filling
        self.next_produce = max(self.next_produce, max(planned, default=-1) + 1)

    # --- delivery -------------------------------------------------------------------------------

    def deliverable(self, member: Member) -> Iterator[tuple[BatchKey, SharedBatch]]:
        """Batches ``member`` may be sent now, in order, within its credits."""
        sid = member.session.session_id
        if self.picks is not None:
            yield from self._deliverable_picked(member)
            return
        while member.active and len(member.session.leases) < member.session.credits:
            key = (self.gen, member.next_send)
            batch = self.batches.get(key)
            if batch is None:
                return
            batch.pending.discard(sid)
            batch.holders.add(sid)
            member.next_send += 1
            yield key, batch

    def _deliverable_picked(self, member: Member) -> Iterator[tuple[BatchKey, SharedBatch]]:
        """Picked mode: every ready batch the member asked for, lowest seq first, within its credits."""
        sid = member.session.session_id
        ready = sorted(
            key for key, batch in self.batches.items() if key[0] == self.gen and sid in batch.pending
        )
        for key in ready:
            if not member.active or len(member.session.leases) >= member.session.credits:
                return
            batch = self.batches[key]
            batch.pending.discard(sid)
            batch.holders.add(sid)
            yield key, batch

    def undeliver(self, member: Member, key: BatchKey) -> None:
        """Take back a batch whose announcement could not be sent: it is due to the member again."""
        sid = member.session.session_id
        batch = self.batches[key]
        batch.holders.discard(sid)
        batch.pending.add(sid)
        if self.picks is None:
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
            self._forget_picked(key)

    def _forget_picked(self, key: BatchKey) -> None:
        """Picked mode: a batch the trainer has let go may be asked for again (it let a second copy
        go, or made room for the batch its loop waits for: NOTE [ A fleet ])."""
        if self.picks is not None and key[0] == self.gen:
            self.planned.discard(key[1])
            self.wanted.discard(key[1])

    def _collect(self) -> None:
        done = [key for key, batch in self.batches.items() if batch.finished]
        self.free(self.batches.pop(key).slot for key in done)
        for key in done:
            self._forget_picked(key)

    def never_started(self, now: float, patience: float) -> list[str]:
        """Broadcast members that attached and have not started while others wait to begin an epoch,
        for longer than ``patience``, each counted from when it attached or when the others began to
        wait, whichever is later: the group cannot begin without them (NOTE [ Broadcast epochs ])."""
        if not self.broadcast or not any(m.want is not None for m in self.members.values()):
            self.waiting_since = None
            return []
        if self.waiting_since is None:
            self.waiting_since = now
        since = self.waiting_since
        return [
            sid
            for sid, m in self.members.items()
            if not m.active and m.want is None and now - max(m.since, since) > patience
        ]

    def laggard(self) -> str | None:
        """The member holding up a full broadcast window: it has not received or released the oldest batch."""
        if not self.broadcast or len(self.members) < 2 or self.in_flight < self.window or not self.batches:
            return None
        live = [key for key, b in self.batches.items() if b.pending or b.holders - self.evicted]
        if not live:
            return None
        oldest = self.batches[min(live)]
        stuck = sorted((oldest.pending | oldest.holders) - self.evicted)
        return stuck[0] if stuck else None
