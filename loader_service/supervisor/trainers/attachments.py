"""The table of who is attached: sessions by connection and by id, and the streams they receive from."""

from __future__ import annotations

from collections import deque

from loader_service.dataset.mixture import Mixture
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.broadcast import BroadcastStream
from loader_service.supervisor.streams.shard import ShardStream
from loader_service.supervisor.streams.stream import Stream
from loader_service.supervisor.trainers.sessions import Session, StreamKey


class Attachments:
    """Who is attached: sessions by connection and by id, and the streams they receive from.

    ``order`` is the round-robin order in which the scheduler breaks ties between streams.
    """

    def __init__(self) -> None:
        self.sessions: dict[bytes, Session] = {}
        self._by_id: dict[str, bytes] = {}
        self._by_token: dict[str, bytes] = {}
        self.streams: dict[StreamKey, Stream] = {}
        self.order: deque[StreamKey] = deque()

    def add(self, session: Session) -> None:
        self.sessions[session.routing_id] = session
        self._by_id[session.session_id] = session.routing_id
        self._by_token[session.token] = session.routing_id

    def by_id(self, session_id: str) -> Session | None:
        routing_id = self._by_id.get(session_id)
        return None if routing_id is None else self.sessions.get(routing_id)

    def by_token(self, token: str) -> Session | None:
        """The session whose secret this is (heartbeats, resume); never found by its public label."""
        routing_id = self._by_token.get(token) if token else None
        session = None if routing_id is None else self.sessions.get(routing_id)
        return session if session is not None and session.presents(token) else None

    def move(self, session: Session, routing_id: bytes) -> None:
        """The session continues on another connection (NOTE [ Reconnecting ])."""
        del self.sessions[session.routing_id]
        session.routing_id = routing_id
        self.add(session)

    def forget(self, session: Session) -> None:
        del self.sessions[session.routing_id]
        self._by_id.pop(session.session_id, None)
        self._by_token.pop(session.token, None)

    def pinned_through(self, feed: int) -> int:
        """Slots ``0 .. this - 1`` of the feed's pool some trainer attached to it may have pinned
        (NOTE [ Giving slots back ] in loader_service/supervisor/slots.py)."""
        return max((s.pinned_through for s in self.sessions.values() if s.feed == feed), default=0)

    def stream_for(self, session: Session, feed: Feed, mixture: Mixture | None) -> Stream:
        """The stream the session receives from, created for its first member with the mixture its
        hello asked for (a later member's was checked to be the same)."""
        key = session.stream_key()
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = make_stream(key, feed, session, mixture)
            self.order.append(key)
        return stream

    def stream_of(self, session: Session) -> Stream:
        return self.streams[session.stream_key()]

    def close_stream(self, stream: Stream) -> None:
        stream.close()
        del self.streams[stream.key]
        self.order.remove(stream.key)

    def starved(self, session: Session) -> bool | None:
        """Could this trainer's loop be waiting on this service's data now (NOTE [ Fleet load ])? None
        if it is in no epoch here. In one, it is starved if it has a credit free and a batch it asked
        for is not ready: in a run in order, the next one; in a picked run, any it named that is still
        queued or decoding. With every credit out it has its batches (or waits on its own releases);
        one ready and not yet announced waits on its connection; neither is decoding's to answer."""
        stream = self.streams.get(session.stream_key())
        member = None if stream is None else stream.members.get(session.session_id)
        if stream is None or member is None or not member.active:
            return None
        if len(session.leases) >= session.credits:
            return False
        if isinstance(stream, ShardStream) and stream.picks is not None:
            return bool(stream.picks) or stream.filling > 0
        return member.next_send < stream.end and (stream.gen, member.next_send) not in stream.batches

    def watch_waits(self, now: float) -> None:
        """Note whether each trainer is ``starved`` now: every housekeeping round, so a window's starved
        seconds are right to a round's length (NOTE [ Fleet load ])."""
        for session in self.sessions.values():
            session.loop.watch(now, self.starved(session))


def make_stream(key: tuple[object, ...], feed: Feed, session: Session, mixture: Mixture | None) -> Stream:
    """The kind of stream the session's mode calls for, chosen once, for its first member."""
    kind = BroadcastStream if session.mode == "broadcast" else ShardStream
    return kind(key, feed, session, mixture)
