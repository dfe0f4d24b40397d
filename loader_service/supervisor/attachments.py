"""The table of who is attached: sessions by connection and by id, and the streams they receive from."""

from __future__ import annotations

from collections import deque

from loader_service.supervisor.broadcast import BroadcastStream
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.sessions import Session, StreamKey
from loader_service.supervisor.shardstream import ShardStream
from loader_service.supervisor.streams import Stream


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

    def stream_for(self, session: Session, feed: Feed) -> Stream:
        """The stream the session receives from, created for its first member."""
        key = session.stream_key()
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = make_stream(key, feed, session)
            self.order.append(key)
        return stream

    def stream_of(self, session: Session) -> Stream:
        return self.streams[session.stream_key()]

    def close_stream(self, stream: Stream) -> None:
        stream.close()
        del self.streams[stream.key]
        self.order.remove(stream.key)


def make_stream(key: tuple[object, ...], feed: Feed, session: Session) -> Stream:
    """The kind of stream the session's mode calls for, chosen once, for its first member."""
    kind = BroadcastStream if session.mode == "broadcast" else ShardStream
    return kind(key, feed, session)
