"""A shard trainer's stream: one per trainer, planned from (seed, epoch, rank, world_size, remainder).

A ``start`` at any epoch and position restarts it there (set_epoch, resume, breaking out of a loop);
the next epoch's first batches are decoded ahead once this one is all planned (NOTE [ Warm start ]).

A picked run (a fleet's trainer, NOTE [ A fleet ] in gpu_worker/fleet_pass.py): the trainer names the
batches of the plan this service decodes (``Start.want`` and ``want`` messages); nothing else is
decoded for it, what is ready is announced in the order asked, and no ``end`` is sent. Whether a run
is picked is chosen at each start; ``picks`` is None for a run in plan order.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator

from loader_service.dataset.mixture import Mixture
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.early import EarlyBatches, Handover
from loader_service.supervisor.streams.producers import Lane
from loader_service.supervisor.streams.stream import BatchKey, Member, SharedBatch, StartRefused, Stream
from loader_service.supervisor.trainers.sessions import Session

log = logging.getLogger(__name__)


class ShardStream(Stream):
    """The batches of one shard trainer, in plan order or as it picks them."""

    def __init__(
        self, key: tuple[object, ...], feed: Feed, session: Session, mixture: Mixture | None
    ) -> None:
        super().__init__(key, feed, session, mixture)
        self.picks: list[int] | None = None
        """Picked run: seqs asked for and not yet planned, a heap: the lowest is decoded next, so a
        batch the trainer waits for, asked again of this service (a backup, NOTE [ A fleet ] in
        gpu_worker/fleet_pass.py), goes before those asked ahead of it. None for a run in plan order."""
        self.wanted: set[int] = set()
        """Picked run: every seq of this plan the trainer asked for."""
        self.planned: set[int] = set()
        """Picked run: seqs planned in this plan (decoding, decoded or delivered)."""
        self.last_asked = False
        """Picked run: the trainer asked this service for the plan's last batch (the next epoch's
        first ones may then be decoded ahead)."""
        self.kept: dict[int, tuple[int, int]] = {}
        """Picked run: seq -> (slot, count) of this plan's early batches (decoded before it asked) that the
        trainer has not asked for yet (NOTE [ Kept batches ])."""

    @property
    def picked(self) -> bool:
        return self.picks is not None

    def planned_batches(self) -> int:
        if self.picks is None:
            return self.next_produce
        return max(self.planned, default=-1) + 1

    @property
    def in_flight(self) -> int:
        """A picked run's trainer counts only what it asked for, so batches decoded ahead never keep
        one it asked for from being decoded (they give way, scheduler.py); a run in order counts them."""
        return self._asked_in_flight() + (self._ahead_held() if self.picks is None else 0)

    def _ahead_held(self) -> int:
        return self.ahead.held if self.ahead is not None else 0

    def wants_ahead(self) -> bool:
        """Epoch fully decoded, credit left: decode the next epoch's first batches."""
        if self.ahead is None or not self.started or not self._all_planned():
            return False
        return self._asked_in_flight() + self._ahead_held() < self.window and self.ahead.wants_batch()

    def _all_planned(self) -> bool:
        if self.picks is None:
            return self.next_produce >= self.end
        return not self.picks and self.last_asked

    # --- starting epochs ------------------------------------------------------------------------

    def on_start(
        self,
        session_id: str,
        epoch: int,
        position: int,
        warm: EarlyBatches | None = None,
        picked: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None:
        if offset and not 0 < offset < (samples := self.epoch_samples or len(self.feed.sources)):
            raise StartRefused(f"offset {offset} is outside the epoch's {samples} samples")
        self._start_shard(self.members[session_id], epoch, position, warm, picked, offset)

    def _start_shard(
        self,
        member: Member,
        epoch: int,
        position: int,
        warm: EarlyBatches | None,
        picked: tuple[int, ...] | None,
        offset: int,
    ) -> None:
        """(Re)start the plan; take batches decoded early (ahead, or warm) if they are its first ones."""
        plan = (epoch, self.rank, self.world_size, self.remainder, offset)
        # The warm start decodes the feed's own order: never a mixture's first batches.
        candidates = (self.ahead, warm if self.mixture is None else None)
        early = next((e for e in candidates if e is not None and e.serves(plan, position)), None)
        self._begin(epoch, position, offset)
        self.picks, self.wanted, self.planned = (None if picked is None else []), set(), set()
        self.last_asked = False
        self._activate(member, 0 if picked is not None else position)
        if picked is not None:
            member.end_sent = True  # a picked run has no end: the trainer counts its batches
        if early is not None:
            self.share_choice(early)  # its epoch is chosen already: no second request
            handover = early.take(self)
            self.adopt(handover)
            if picked is not None:
                self._keep_picked(handover, picked)
            log.debug(
                "%s took %d batches of epoch %d decoded early (%s), %d of them still decoding",
                self.key[1],
                len(handover.ready) + len(handover.filling),
                epoch,
                early.lane.value,
                len(handover.filling),
            )
        following = (epoch + 1, self.rank, self.world_size, self.remainder, 0)
        if self.ahead is None:
            self.ahead = EarlyBatches(
                self.feed, self.window, following, Lane.AHEAD, self.mixture, self.requester, self.encode_share
            )
        else:
            self.ahead.retarget(following)
        if picked is not None:
            self.want(picked, member.session.credits)

    def _keep_picked(self, handover: Handover, picked: tuple[int, ...]) -> None:
        """Picked mode: of the early batches handed over, keep the decoded batches the start did not ask
        for aside, not announced (NOTE [ Kept batches ]); those still decoding join them when they
        complete, unless asked for by then.

        NOTE [ Kept batches ]
            A picked start names only the batches the trainer hands this service at once (a few,
            by its pace: NOTE [ A fleet ] in gpu_worker/fleet_pass.py), while the next epoch's first
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
            elif seq not in self.planned:  # else handed over as early batches, or still decoding there
                if len(self.picks) >= limit:
                    continue
                heapq.heappush(self.picks, seq)
                self.planned.add(seq)
            self.wanted.add(seq)
            self.last_asked = self.last_asked or seq == self.end - 1

    def _announce_kept(self, seq: int) -> None:
        slot, count = self.kept.pop(seq)
        self.batches[(self.gen, seq)] = SharedBatch(slot, count, self._active_ids())

    def next_seq(self) -> int:
        if self.picks is None:
            return super().next_seq()
        return heapq.heappop(self.picks)

    def _begin(self, epoch: int, position: int, offset: int = 0) -> None:
        super()._begin(epoch, position, offset)
        self.drop_kept()

    def close(self) -> None:
        self.drop_kept()
        super().close()

    # --- production -----------------------------------------------------------------------------

    def wants_batch(self) -> bool:
        if self.picks is None:
            return super().wants_batch()
        return self.started and bool(self.picks) and self.in_flight < self.window and self.order_ready()

    def filled(self, gen: int, seq: int, slot: int, count: int) -> bool:
        """As a stream's; a picked run keeps a batch nobody asked for yet (an early one, still decoding
        when the start passed it over) aside (NOTE [ Kept batches ])."""
        if gen == self.gen and self.picks is not None and seq not in self.wanted:
            self.filling -= 1
            self.kept[seq] = (slot, count)
            return True
        return super().filled(gen, seq, slot, count)

    # --- delivery -------------------------------------------------------------------------------

    def deliverable(self, member: Member) -> Iterator[tuple[BatchKey, SharedBatch]]:
        if self.picks is not None:
            yield from self._deliverable_picked(member)
            return
        yield from super().deliverable(member)

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

    def _forget(self, key: BatchKey) -> None:
        """Picked run: a batch the trainer has let go may be asked for again (it let a second copy
        go, or made room for the batch its loop waits for: NOTE [ A fleet ])."""
        if self.picks is not None and key[0] == self.gen:
            self.planned.discard(key[1])
            self.wanted.discard(key[1])
