"""Trainer messages: hello, start, release, heartbeat and bye, and the sessions they open and end.

Also the two ways a session ends without a bye: its heartbeats stop (``expire``), or it holds its
broadcast group up for too long (``evict_laggards``, NOTE [ Broadcast epochs ]).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

from loader_service.config import ServiceConfig
from loader_service.dataset.mixture import Mixture, describe
from loader_service.dataset.tables import DatasetError
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.broadcast import BroadcastStream
from loader_service.supervisor.streams.early import EarlyBatches
from loader_service.supervisor.streams.orders import OrderBudget
from loader_service.supervisor.streams.shard import ShardStream
from loader_service.supervisor.streams.stream import StartRefused, Stream
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.limits import RateGate
from loader_service.supervisor.trainers.outbox import Outbox
from loader_service.supervisor.trainers.sessions import Session, credit_cap, group_key
from protocol.codec import decode
from protocol.messages import (
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Spoiled,
    Start,
    StatusReply,
    StatusRequest,
    Want,
    Welcome,
)
from protocol.printable import printable
from protocol.shares import shard_size

log = logging.getLogger(__name__)
TRAINER_MESSAGES = (Hello, Start, Want, Release, Ack, Heartbeat, Spoiled, Bye, StatusRequest)


class TrainerDesk:
    def __init__(
        self,
        config: ServiceConfig,
        feeds: Sequence[Feed],
        warm: dict[int, EarlyBatches],
        attached: Attachments,
        outbox: Outbox,
        status: Callable[[], dict[str, object]],
    ) -> None:
        self._config = config
        self._feeds = feeds
        self._warm = warm
        self._attached = attached
        self._outbox = outbox
        self._status = status
        self._gate = RateGate()
        self._orders = OrderBudget(config.order_memory)
        self._beating: dict[bytes, float] = {}
        """Heartbeat connections that carried a live session's token, and when they last did."""
        self._labels = itertools.count(1)

    def on_frames(self, frames: list[bytes]) -> None:
        routing_id = frames[0]
        now = time.monotonic()
        size = sum(len(frame) for frame in frames[1:])
        if not self._gate.admit(routing_id, now, self._established(routing_id, now), size):
            self._outbox.note_flood(routing_id)
            return
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected one frame, got {len(frames) - 1}")
            msg = decode(frames[1], TRAINER_MESSAGES)
        except ProtocolError as exc:
            self._outbox.reject(routing_id, "bad-message", str(exc))
            return
        self._on_message(routing_id, msg)

    def _on_message(self, routing_id: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(routing_id, msg)
            return
        if isinstance(msg, StatusRequest):
            self._outbox.send(routing_id, StatusReply(self._status()))
            return
        if isinstance(msg, Heartbeat):  # keeps alive only the session whose token it carries
            beating = self._attached.by_token(msg.token)
            if beating is not None:
                beating.last_seen = time.monotonic()
                beating.loop.heard(beating.last_seen, msg, beating.delivered)
                if msg.encode >= 0:
                    beating.encode_now = msg.encode
                self._note_beat(routing_id, beating.last_seen)
            return
        session = self._attached.sessions.get(routing_id)
        if session is None:
            why = "send hello first (the service may have restarted)"
            self._outbox.reject(routing_id, "no-session", why, fatal=True)
            return
        if isinstance(msg, (Start, Want, Release, Ack, Spoiled, Bye)) and not session.presents(msg.token):
            self._outbox.reject(routing_id, "bad-token", "this message does not carry its session's token")
            return
        session.last_seen = time.monotonic()
        if isinstance(msg, Start) and session.evicted:
            why = "this trainer was evicted from its broadcast group"
            self._outbox.reject(routing_id, "evicted", why, fatal=True)
        elif isinstance(msg, Start):
            self._on_start(session, msg)
        elif isinstance(msg, Want):
            self._on_want(session, msg)
        elif isinstance(msg, Release):
            self._on_release(session, msg)
        elif isinstance(msg, Ack):
            self._on_ack(session, msg)
        elif isinstance(msg, Spoiled):
            self._on_spoiled(session, msg)
        elif isinstance(msg, Bye):
            self.drop(session, "said bye")

    def _established(self, routing_id: bytes, now: float) -> bool:
        """Does this connection carry a session, or a live session's heartbeats? The rate gate spares
        those the budget that connections nobody has vouched for share."""
        if routing_id in self._attached.sessions:
            return True
        seen = self._beating.get(routing_id)
        return seen is not None and now - seen <= self._config.client_timeout

    def _note_beat(self, routing_id: bytes, now: float) -> None:
        self._beating[routing_id] = now
        if len(self._beating) > 4 * self._config.max_sessions:  # forget the long gone, in bulk
            timeout = self._config.client_timeout
            self._beating = {rid: t for rid, t in self._beating.items() if now - t <= timeout}

    # --- attaching ------------------------------------------------------------------------------

    def _find_feed(self, name: str) -> Feed | None:
        if not name:
            return self._feeds[0]
        return next((f for f in self._feeds if f.name == name), None)

    def _admit(self, msg: Hello) -> tuple[Feed, Mixture | None] | str:
        """The feed a hello asks for and the mixture its weights make (derived here once, NOTE
        [ Mixture order ]), or why it cannot be served."""
        feed = self._find_feed(msg.feed)
        if feed is None:
            served = ", ".join(repr(f.name) for f in self._feeds)
            return f"this service serves feed(s) {served}, not {msg.feed!r}"
        refusal = feed.refusal(msg)
        if refusal is not None:
            return refusal
        try:
            asked = feed.mixture_of(msg)
        except DatasetError as exc:
            return str(exc)
        if msg.mode != "broadcast":
            return feed, asked
        stream = self._attached.streams.get(group_key(feed.id, msg.group, msg.group_secret))
        if stream is not None and stream.group_size != msg.group_size:
            return (
                f"broadcast group {stream.group!r} has group_size {stream.group_size}, not {msg.group_size}"
            )
        if stream is not None and stream.mixture != asked:
            # One group, one order: a member with other weights would get the group's batches.
            names = feed.sources.names
            return (
                f"broadcast group {stream.group!r} reads {describe(stream.mixture, names)}; "
                f"this trainer asked for {describe(asked, names)}"
            )
        return feed, asked

    def _on_hello(self, routing_id: bytes, msg: Hello) -> None:
        admitted = self._admit(msg)
        if isinstance(admitted, str):
            self._outbox.reject(routing_id, "refused", admitted, fatal=True)
            return
        feed, asked = admitted
        old = self._attached.sessions.get(routing_id)
        if old is not None and old.run < 0 and old.opened_by == msg:
            # The same hello again on the same connection, before any start: the trainer resent it
            # because no welcome had come yet (it resends every few seconds, and ZeroMQ queues them
            # for a service that is down). Welcome it again rather than replace the session it
            # will know by the first welcome that arrives.
            self._outbox.send(routing_id, self._welcome(old))
            return
        resumed = self._attached.by_token(msg.resume)
        if resumed is not None and resumed.hello.pid == msg.pid and not resumed.evicted:
            self._rebind(resumed, routing_id, msg)
            return
        if old is not None:
            self.drop(old, "said hello again")
        limit = self._config.max_sessions
        if len(self._attached.sessions) >= limit:
            why = f"this service already serves its limit of {limit} trainers (--max-sessions)"
            self._outbox.reject(routing_id, "refused", why, fatal=True)
            return
        too_much = self._order_refusal(feed, msg, asked)
        if too_much is not None:
            self._outbox.reject(routing_id, "refused", too_much, fatal=True)
            return
        label = f"t{next(self._labels)}"  # public: status and logs show it; the token stays secret
        session = Session(routing_id, label, msg, feed.id, time.monotonic(), opened_by=msg)
        session.max_credits = credit_cap(feed.reach())  # NOTE [ Credits per session ]
        if session.credits < msg.credits:
            log.info("session %s asked %d credits; granted %d", label, msg.credits, session.credits)
        self._attached.add(session)
        stream = self._attached.stream_for(session, feed, asked)  # a group's: checked to be ``asked``
        stream.add(session)
        log.info(
            "trainer %s (pid %d) attached to feed %r as session %s (%s)",
            session.client,
            msg.pid,
            feed.name,
            session.session_id,
            f"shard {session.rank}/{session.world_size}"
            if session.mode == "shard"
            else f"broadcast group {session.group!r}",
        )
        self._outbox.send(routing_id, self._welcome(session))

    def _order_refusal(self, feed: Feed, msg: Hello, asked: Mixture | None) -> str | None:
        """NOTE [ Orders' memory ]: why a weighted job's orders cannot be held beside the others'."""
        key = group_key(feed.id, msg.group, msg.group_secret)
        if asked is None or (msg.mode == "broadcast" and key in self._attached.streams):
            return None  # no order, or the group's (checked to be the same, ``_admit``)
        held = (s.mixture for s in self._attached.streams.values() if s.mixture is not None)
        return self._orders.refusal(held, asked)

    def _rebind(self, session: Session, routing_id: bytes, hello: Hello) -> None:
        """NOTE [ Reconnecting ]: a trainer that lost touch with this (live) service takes its session
        back on a new socket. Of the leases it had received every one of (up to ``have``), those its
        loop still holds keep their slots and the others are returned (releases the old socket
        lost); every later one is announced again after the welcome, as it may have been lost with
        the old connection (NOTE [ Acknowledged delivery ])."""
        held, have = set(hello.held), hello.have
        if session.routing_id == routing_id and session.opened_by == hello:
            self._outbox.send(routing_id, self._welcome(session))  # a repeat: it is done already
            return
        session.opened_by = hello
        displaced = self._attached.sessions.get(routing_id)
        if displaced is not None and displaced is not session:
            # One connection, one session: the other one ends now, its slots with it, rather than
            # lingering unreachable (and being mistaken for this one by broadcast eviction).
            self.drop(displaced, f"its connection resumed session {session.session_id}")
        stream = self._attached.stream_of(session)
        self._return_released(session, stream, have, held)
        self._attached.move(session, routing_id)
        self._outbox.sends.orphan(session.session_id)  # the old connection's copies: NOTE [ Remote sends ]
        session.last_seen = time.monotonic()
        log.info("session %s (%s) resumed on a new connection", session.session_id, session.client)
        self._outbox.send(routing_id, self._welcome(session))
        self._outbox.announce_again(
            stream, session, [lease for lease in session.leases if lease > have], True
        )
        member = stream.members.get(session.session_id)
        if member is not None and member.active:
            member.end_sent = False  # the old connection may have lost it too
        self._outbox.deliver(stream)

    def _return_released(self, session: Session, stream: Stream, have: int, held: set[int]) -> int:
        """Free the leases up to ``have`` that the trainer no longer holds: it released them, and the
        release was lost (NOTE [ Acknowledged delivery ]). Returns how many."""
        gone = [lease for lease in session.leases if lease <= have and lease not in held]
        for lease in gone:
            stream.release(session.session_id, session.leases.pop(lease).key)
        return len(gone)

    def _on_ack(self, session: Session, msg: Ack) -> None:
        """NOTE [ Acknowledged delivery ]: free what the trainer released without the service
        hearing it, and announce again what never reached the trainer."""
        stream = self._attached.stream_of(session)
        if msg.have > session.sent:
            self._outbox.reject(
                session.routing_id, "bad-ack", f"acknowledged lease {msg.have} of {session.sent}"
            )
            return
        recovered = self._return_released(session, stream, msg.have, set(msg.held))
        if recovered:
            session.recovered += recovered
            log.info(
                "session %s: %d releases never arrived; their slots are returned",
                session.session_id,
                recovered,
            )
        missing = [lease for lease in msg.missing if lease > msg.have]
        if missing:
            log.info(
                "session %s: %d announcements never arrived; sending them again",
                session.session_id,
                len(missing),
            )
            self._outbox.announce_again(stream, session, missing)
        self._outbox.deliver(stream)

    def _welcome(self, session: Session) -> Welcome:
        feed = self._feeds[session.feed]
        stream = self._attached.stream_of(session)
        samples = shard_size(stream.epoch_samples or len(feed.sources), stream.world_size, stream.remainder)
        return Welcome(
            session.session_id,
            feed.info(stream.mixture),
            self._config.heartbeat_interval,
            stream.batches_per_epoch(),
            samples,
            token=session.token,
            credits=session.credits,
        )

    # --- running --------------------------------------------------------------------------------

    def _on_start(self, session: Session, msg: Start) -> None:
        if msg.run == session.run:
            return  # sent again by a trainer that had not yet seen it arrive: it is in effect
        stream = self._attached.stream_of(session)
        session.run, session.epoch = msg.run, msg.epoch
        session.remote = msg.transport == "tcp"
        warm = self._warm.get(stream.feed.id)
        picked = msg.want if msg.picked else None
        try:
            stream.reweight(msg.changes)
            stream.on_start(session.session_id, msg.epoch, msg.position, warm, picked, msg.offset)
        except StartRefused as exc:
            self._outbox.reject(session.routing_id, "bad-start", str(exc), fatal=True)
            return
        self._outbox.deliver(stream)

    def _on_want(self, session: Session, msg: Want) -> None:
        """A picked run's trainer asks for more of its batches; one of an older run is ignored."""
        if msg.run != session.run:
            return
        stream = self._attached.stream_of(session)
        if isinstance(stream, ShardStream):
            stream.want(msg.seqs, session.credits)

    def _on_spoiled(self, session: Session, msg: Spoiled) -> None:
        """Encoded rows the trainer could not decode (NOTE [ Encoded rows ]): each a bad sample,
        logged and counted like one a worker found, at most as many as the rows it was sent. A
        peer's word is not a worker's: it never stops a ``--strict`` service."""
        feed = self._feeds[session.feed]
        room = session.delivered * feed.config.batch_size - session.spoiled
        for idx, reason in msg.samples[: max(0, room)]:
            session.spoiled += 1
            feed.note_bad(idx, f"{printable(reason)[:200]} (decoded by trainer {session.client})")

    def _on_release(self, session: Session, msg: Release) -> None:
        stream = self._attached.stream_of(session)
        unknown = 0
        for lease in msg.leases:
            leased = session.leases.pop(lease, None)
            if leased is None:
                unknown += 1
                continue
            stream.release(session.session_id, leased.key)
        if unknown:
            self._outbox.rejected_messages += 1
            log.warning(
                "session %s released %d leases it does not hold; ignored", session.session_id, unknown
            )
        self._outbox.deliver(stream)

    # --- ending ---------------------------------------------------------------------------------

    def drop(self, session: Session, why: str) -> None:
        """Return every slot the session holds (NOTE [ Slot lifecycle ]: cancel and lease expiry)."""
        stream = self._attached.stream_of(session)
        stream.remove(session.session_id)
        log.info(
            "session %s (%s) detached: %s; %d leases returned",
            session.session_id,
            session.client,
            why,
            len(session.leases),
        )
        session.leases.clear()
        self._outbox.sends.orphan(session.session_id)
        self._attached.forget(session)
        if not stream.members and not stream.evicted:
            self._attached.close_stream(stream)
        elif isinstance(stream, BroadcastStream):
            stream.on_member_left()
            self._outbox.deliver(stream)

    def expire(self, now: float) -> None:
        """Drop sessions whose heartbeats stopped, and remote ones that stopped reading (NOTE
        [ Remote sends ]): either way, their slots return within the client timeout."""
        timeout = self._config.client_timeout
        # Copies that went out since the last send are forgotten first: kept until then, they made a
        # remote trainer that took no batch for the client timeout (a long step, an evaluation
        # between epochs) look like one that stopped reading, and it was dropped.
        self._outbox.sends.settle()
        for session in list(self._attached.sessions.values()):
            stuck = self._outbox.sends.stuck_since(session.session_id)
            if now - session.last_seen > timeout:
                self.drop(session, f"no heartbeat for {timeout:.0f} s")
            elif stuck is not None and now - stuck > timeout:
                self.drop(session, f"stopped reading: a batch sent {now - stuck:.0f} s ago has not gone out")

    def evict_laggards(self, now: float) -> None:
        """NOTE [ Broadcast epochs ]: one member may not hold its group up beyond the lag timeout,
        by lagging or by never starting; each stream says whom (``Stream.to_evict``)."""
        for stream in list(self._attached.streams.values()):
            for session_id, how in stream.to_evict(now, self._config.lag_timeout):
                session = self._attached.by_id(session_id)
                if session is not None and not session.evicted:
                    self._evict(stream, session, how)

    def _evict(self, stream: Stream, session: Session, how: str) -> None:
        why = f"{how} broadcast group {stream.group!r} up for over {self._config.lag_timeout:.0f} s"
        log.warning("session %s (%s) evicted: %s", session.session_id, session.client, why)
        session.evicted = True
        stream.evict(session.session_id)
        stream.on_member_left()
        self._outbox.reject(session.routing_id, "evicted", f"evicted: {why}", fatal=True)
        self._outbox.deliver(stream)
