"""A broadcast group's stream: every member receives every batch, each decoded once.

NOTE [ Broadcast epochs ]
    The group's first epoch begins when ``group_size`` members have started it (they must agree on
    the epoch; if their positions differ, as after a service restart, the group decodes from the
    earliest and each member receives from its own, so each still sees each image once). Later
    epochs begin when every member has finished the current one and started the next: members
    iterate epochs together. A member that starts the epoch the group is
    already in (a late joiner, or one that rejoined after dying) receives it from the oldest batch
    still held, so it may miss the batches before that: exactly-once holds for members that stay.
    When the last member in the epoch leaves and none is waiting for the next, the epoch is
    abandoned and the group begins afresh with whoever starts next (``Stream._abandon_epoch``).
    A member that holds the group up for longer than the lag timeout is evicted (trainers/desk.py), and so
    is one that attached and never started while the others wait to begin: it gets no further
    batches, but keeps the slots of those it holds until it releases them, so a slow step never sees
    its batch overwritten. A dead member is dropped after its heartbeat timeout, and its
    slots with it. Either way the others never stall for longer than those timeouts.
"""

from __future__ import annotations

from loader_service.dataset.mixture import Mixture
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.early import EarlyBatches
from loader_service.supervisor.streams.stream import Member, StartRefused, Stream
from loader_service.supervisor.trainers.sessions import Session


class BroadcastStream(Stream):
    """The batches of one broadcast group (NOTE [ Broadcast epochs ])."""

    def __init__(
        self, key: tuple[object, ...], feed: Feed, session: Session, mixture: Mixture | None
    ) -> None:
        super().__init__(key, feed, session, mixture)
        self.waiting_since: float | None = None
        """Since when members have been waiting to begin an epoch that others have not started."""
        self.blocked_since: float | None = None
        """Since when a laggard has held up a full window (``to_evict``)."""

    def on_start(
        self,
        session_id: str,
        epoch: int,
        position: int,
        warm: EarlyBatches | None = None,
        picked: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None:
        member = self.members[session_id]
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
        self._check_start(member, epoch, position)
        member.active, member.want = False, (epoch, position)
        self._members_changed()

    def _check_start(self, member: Member, epoch: int, position: int) -> None:
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

    def _members_changed(self) -> None:
        """Begin the group's epoch once every member waits for it (the first: ``group_size``)."""
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

    def _join_running(self, member: Member) -> None:
        current = [seq for gen, seq in self.batches if gen == self.gen]
        start = min(current, default=self.next_produce)
        self._activate(member, start)
        for (gen, seq), batch in self.batches.items():
            if gen == self.gen and seq >= start:
                batch.pending.add(member.session.session_id)

    def to_evict(self, now: float, patience: float) -> list[tuple[str, str]]:
        """NOTE [ Broadcast epochs ]: no member may hold the group up for longer than ``patience``:
        not by staying attached without starting while the others wait to begin an epoch, nor by
        not receiving or releasing the oldest batch of a full window for that long."""
        out = [(sid, "never started, holding") for sid in self.never_started(now, patience)]
        laggard = self.laggard()
        if laggard is None:
            self.blocked_since = None
        elif self.blocked_since is None:
            self.blocked_since = now
        elif now - self.blocked_since > patience:
            self.blocked_since = None
            out.append((laggard, "held"))
        return out

    def never_started(self, now: float, patience: float) -> list[str]:
        """Members that attached and have not started while others wait to begin an epoch, for
        longer than ``patience``, each counted from when it attached or when the others began to
        wait, whichever is later: the group cannot begin without them (NOTE [ Broadcast epochs ])."""
        if not any(m.want is not None for m in self.members.values()):
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
        """The member holding up a full window: it has not received or released the oldest batch."""
        if len(self.members) < 2 or self.in_flight < self.window or not self.batches:
            return None
        live = [key for key, b in self.batches.items() if b.pending or b.holders - self.evicted]
        if not live:
            return None
        oldest = self.batches[min(live)]
        stuck = sorted((oldest.pending | oldest.holders) - self.evicted)
        return stuck[0] if stuck else None
