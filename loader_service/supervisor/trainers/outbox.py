"""Everything the service sends to trainers: announcements in order, epoch ends, heartbeats, refusals.

Nothing here ever blocks the main loop: a message that cannot go out now (a full or briefly
unreachable peer) is kept as owed and sent again on a later delivery round (NOTE [ Owed messages ]).

NOTE [ Owed messages ]
    A ``batch`` announcement that fails to send is taken back (``Stream.undeliver``) and the lease is
    never recorded; an ``epoch_end`` is marked sent only once it has gone out. Every heartbeat
    interval the loop runs a delivery round over every stream, so both are retried until the peer
    takes them or its session ends. Heartbeats and refusals are not retried: the next heartbeat
    replaces a lost one, and a refused peer asks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from loader_service.logs import LogLimiter
from loader_service.supervisor.slots import SlotState
from loader_service.supervisor.streams.stream import Member, Stream
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.ledger import count_served
from loader_service.supervisor.trainers.sends import Send as SlotSend
from loader_service.supervisor.trainers.sends import SendBudget
from loader_service.supervisor.trainers.sessions import Leased, Session
from protocol.messages import BatchReady, EpochEnd, ErrorReply, Heartbeat, Message

log = logging.getLogger(__name__)
Send = Callable[[bytes, Message], bool]
"""Send a message to a routing id without blocking; False if it did not go out."""
SendFrames = Callable[[bytes, Message, list[memoryview]], "SlotSend | None"]
"""Send a message followed by copies of a slot's views; the send's tracker, or None."""


class _Done:
    """A send that holds nothing (a local trainer's announcement)."""

    done = True


DONE: SlotSend = _Done()


class Outbox:
    def __init__(
        self,
        send: Send,
        send_frames: SendFrames,
        attached: Attachments,
        heartbeat_interval: float,
        sends: SendBudget,
        observe_ready_wait: Callable[[str, float], None] | None = None,
    ) -> None:
        self.send = send
        self._send_frames = send_frames
        self._attached = attached
        self._heartbeat_interval = heartbeat_interval
        self.sends = sends
        """Copies on their way to remote trainers (NOTE [ Remote sends ])."""
        self._last_heartbeat = 0.0
        self.rejected_messages = 0
        self._reject_log = LogLimiter("rejected messages", per_minute=30)
        self.observe_ready_wait = observe_ready_wait
        """Where the time a batch waited ready before its first lease goes (metrics, when on)."""

    def deliver(self, stream: Stream) -> None:
        """Announce what each member may receive, strictly in sequence order."""
        for member in stream.members.values():
            self._announce(stream, member)
            self._maybe_end(stream, member)

    def _announce(self, stream: Stream, member: Member) -> None:
        session = member.session
        for key, batch in stream.deliverable(member):
            # A lease id is taken only once its announcement went out, so a session's ids have no
            # holes the trainer could mistake for a lost announcement (NOTE [ Acknowledged delivery ]).
            lease = session.next_lease
            announced = BatchReady(session.run, stream.epoch, key[1], lease, batch.slot, batch.count)
            sent = self._send_batch(stream, session, announced)
            if sent is None:
                stream.undeliver(member, key)  # NOTE [ Owed messages ]
                return
            session.next_lease += 1
            if stream.feed.pool.state(batch.slot) is SlotState.READY:  # first member to get it
                waited = stream.feed.pool.lease(batch.slot)
                if self.observe_ready_wait is not None:
                    self.observe_ready_wait(stream.feed.name, waited)
            session.leases[lease] = Leased(key, announced, sent)
            session.note_announced(batch.slot)  # NOTE [ Giving slots back ]
            session.delivered += 1
            session.served = count_served(stream.feed, session.served, batch.slot, batch.count)

    def announce_again(
        self, stream: Stream, session: Session, leases: Iterable[int], force: bool = False
    ) -> None:
        """Send again the announcements of ``leases`` the trainer says never arrived, in lease order
        (NOTE [ Acknowledged delivery ]). Each goes at most once per heartbeat interval, unless
        ``force``d (a resumed session's lost connection), so asking again and again costs a peer
        its own bandwidth, not the service's."""
        now = time.monotonic()
        for lease in sorted(set(leases)):
            leased = session.leases.get(lease)
            if leased is None or (not force and now - leased.resent_at < self._heartbeat_interval):
                continue
            if not force and not leased.send.done:
                continue  # its copy is still on its way: never two copies of one batch queued
            sent = self._send_batch(stream, session, leased.announced)
            if sent is None:
                return  # the peer is full or gone: it asks again, or its session ends
            leased.send, leased.resent_at = sent, now
            session.resent += 1

    def _send_batch(self, stream: Stream, session: Session, announced: BatchReady) -> SlotSend | None:
        """A local trainer maps the slot; a remote one is sent a copy of its bytes (NOTE [ Remote
        sends ]). The send, or None if it could not go out now."""
        if not session.remote:
            return DONE if self.send(session.routing_id, announced) else None
        frames = stream.feed.slot_frames(announced.slot, announced.count)
        nbytes = sum(len(frame) for frame in frames)
        if not self.sends.room(session.session_id, nbytes, session.credits):
            return None
        sent = self._send_frames(session.routing_id, announced, frames)
        if sent is not None:
            self.sends.add(session.session_id, sent, nbytes)
        return sent

    def _maybe_end(self, stream: Stream, member: Member) -> None:
        if member.active and not member.end_sent and member.next_send >= stream.end:
            session = member.session
            # NOTE [ Owed messages ]: marked sent only once it went out, so a lost one is sent again.
            member.end_sent = self.send(session.routing_id, EpochEnd(session.run, stream.epoch, stream.end))

    def heartbeat(self, now: float) -> None:
        """Heartbeat every trainer, and retry what is owed, once per heartbeat interval."""
        if now - self._last_heartbeat < self._heartbeat_interval:
            return
        self._last_heartbeat = now
        for routing_id, session in list(self._attached.sessions.items()):
            self.send(routing_id, Heartbeat(sent=session.sent, run=session.run))
        for stream in list(self._attached.streams.values()):
            self.deliver(stream)

    def note_flood(self, routing_id: bytes) -> None:
        """A message over the connection's rate limit was dropped unanswered."""
        self.rejected_messages += 1
        if self._reject_log.allow(time.monotonic()):
            log.warning("dropped messages from %r: over the per-connection rate limit", routing_id[:16])

    def reject(self, routing_id: bytes, code: str, message: str, fatal: bool = False) -> None:
        self.rejected_messages += 1
        if self._reject_log.allow(time.monotonic()):
            log.warning("rejected message from %r: %s", routing_id[:16], message)
        self.send(routing_id, ErrorReply(code, message[:2000], fatal))
