"""A trainer's session with one service: its socket, hello/welcome, and noticing loss. Never blocks.

The loader polls every service's ``sock`` with one poller (``gpu_worker.passes``) and calls ``read``
when it is readable and ``tick`` at every wake-up; ``events`` says what happened to the session
(opened, resumed, lost). Heartbeats go from ``gpu_worker.heartbeats``' one thread, on sockets of its
own, carrying the session's token, so a long training step never looks like a dead trainer.
Every ``connect`` makes a fresh socket (new routing id), so nothing queued for a previous service
instance is ever delivered to the next one. Every session message carries the token the welcome
gave (``send`` adds it). A ``batch`` for a trainer on another host arrives with its bytes as more
frames, one per field and one for the indices; they wait in ``payloads`` until the loader takes them
with the batch, which checks them against the feed's layout. Announcements pass through
``gpu_worker.arrivals`` first, which hands them on in lease order, each once, and finds the ones a
lost connection swallowed (NOTE [ Acknowledged delivery ]).

NOTE [ Reconnecting ]
    When a service restarts (it answers ``no-session``) or goes silent for several heartbeats, the
    loader opens a new connection to it, without waiting, and asks to resume its session, naming
    the leases its loop still holds or has not taken yet and how far it has received every
    announcement. Meanwhile the other services of the fleet take over its unfinished batches.
    A service that was only stalled still has the session: it keeps those leases (their slots stay
    untouched), returns the others, announces again everything after what was received (NOTE
    [ Acknowledged delivery ] in ``gpu_worker/arrivals.py``) and carries on with the same pool and
    the same run: nothing is lost or doubled, in shard and broadcast mode alike.
    A restarted service (or one that had already given the session up) does not know it: the loader
    gets a new session, checks that the feed is the same dataset with the same seed, geometry and
    fields, and maps the new pool; if an epoch is under way, a new run starts there: in shard mode
    the batches it owed and those received but not yet handed out are assigned again; a broadcast
    member starts again at the position its loop reached. Batches the loop still holds stay valid
    (a resumed session keeps their leases; after a restart their old mapping lives as long as they
    do). In shard mode each image of the epoch is therefore still seen exactly once. If no batch
    arrives from any service within ``timeout``, ServiceTimeout names every endpoint and its state.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

import zmq

from gpu_worker.arrivals import Arrivals
from gpu_worker.heartbeats import Heartbeats
from gpu_worker.peer import Credentials, check_listener, peer_credentials
from protocol.codec import decode, encode
from protocol.curve import ClientKeys
from protocol.layout import MAX_FIELDS
from protocol.messages import (
    MAX_CREDITS,
    MAX_RELEASES,
    Ack,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Spoiled,
    Start,
    Want,
    Welcome,
)
from protocol.printable import printable

log = logging.getLogger(__name__)


class SessionEvent(enum.Enum):
    """What happens to a session, as its connection tells the fleet and the fleet the pass."""

    OPENED = "opened"
    """A new session (the first, or after the service restarted): it owes nothing from before."""
    RESUMED = "resumed"
    """The same session taken back on a new connection."""
    LOST = "lost"
    """The service restarted or went silent: the owner reconnects."""
    REFUSED = "refused"
    """Left out of the fleet for good (another feed, or its address gone from its name)."""


SERVICE_MESSAGES = (Welcome, BatchReady, EpochEnd, Heartbeat, ErrorReply)
BYE_LINGER_MS = 500
"""Milliseconds a closing session's socket has to deliver its ``bye``: waited on a thread of its
own (``Connection.close``), never by the loop, and by ``Fleet.close`` once for every service."""
SILENCE_HEARTBEATS = 5
"""Missed service heartbeats after which the session counts as lost and is reopened."""
SLOWEST_LINK = 10e6
"""Bytes a second the slowest network a remote trainer should work over carries. A heartbeat queued
behind a batch arrives only after it, so silence is allowed to last as long as one batch takes."""
HELLO_AGAIN = 2.0
"""Seconds without a welcome after which the hello is sent again (a connection lost on the way)."""
SEND_HWM = 64
"""Messages the main socket queues for a service that is not reading before a send is refused. It
carries only starts, releases and a bye; the loader keeps refused ones itself, merged, and sends them
again (NOTE [ Releases that could not be sent ]), so a deep queue here would only hold stale copies."""


class ServiceError(RuntimeError):
    """The service refused the trainer, or answered with something it should not have."""


class ServiceTimeout(ServiceError, TimeoutError):
    """No answer in time; the message says what was awaited and what the trainer still holds."""


class Connection:
    def __init__(self, endpoint: str, hello: Hello, keys: ClientKeys | None, heartbeats: Heartbeats) -> None:
        self.endpoint = endpoint
        self._hello = hello
        self._keys = keys
        self._heartbeats = heartbeats
        self.token = ""
        self.payloads: dict[int, list[zmq.Frame]] = {}
        """Lease -> the frames that came with its batch: its fields', then its indices (TCP transport)."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock: zmq.Socket[bytes] | None = None
        self._inbox: deque[Message] = deque()
        self._kept: deque[Message] = deque()
        """What arrived and was not taken when the connection was lost: kept if the session resumes."""
        self.events: deque[tuple[SessionEvent, Any]] = deque()
        """``(OPENED, welcome)``, ``(RESUMED, welcome)`` or ``(LOST, why)``, oldest first."""
        self.session = ""
        self.incarnation = 0
        self.last_heard = time.monotonic()
        self._silence_limit = float("inf")
        self.batch_bytes = 0
        """Bytes one batch brings over the socket (TCP transport), which stretch the silence allowed."""
        self.arrivals: Arrivals[list[zmq.Frame] | None] = Arrivals(MAX_CREDITS)
        self.service_run = -1
        """The run the service's last heartbeat said it serves this session."""
        self.heard_run_at = 0.0
        self.heartbeat_interval = 1.0
        self._hello_frame = b""
        self._hello_at = 0.0
        self._resuming = ""
        self.peer: Credentials | None = None
        """The process that answered on an ``ipc://`` endpoint, checked (NOTE [ A service's
        identity ] in gpu_worker/peer.py); None over TCP."""

    @property
    def connecting(self) -> bool:
        return self.sock is not None and not self.session

    def connect(self, held: tuple[int, ...] = ()) -> None:
        """Ask for a session, or to take the last one back if the service still has it; the welcome
        arrives through ``read`` (an ``opened`` or ``resumed`` event).

        A resumed session keeps what had arrived and not yet been taken (NOTE [ Acknowledged
        delivery ]): the hello names ``held`` and ``have``, and the service frees and announces
        again accordingly. A new one starts from nothing: the old leases died with the old session.
        """
        self._resuming = self.token
        self._kept, self._inbox = self._inbox, deque()
        self._close_session()
        sock = self.sock = self._socket()
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        sock.connect(self.endpoint)
        resume = self._resuming
        have = self.arrivals.have if resume else 0
        self._hello_frame = encode(
            replace(self._hello, resume=resume, held=held if resume else (), have=have)
        )
        self._send_hello(time.monotonic())

    def _send_hello(self, now: float) -> None:
        """A hello lost with a connection is sent again (the service welcomes a repeated hello again
        rather than opening a second session)."""
        assert self.sock is not None
        self._hello_at = now
        try:
            self.sock.send(self._hello_frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # nothing to send to yet: the next round tries again

    def tick(self, now: float) -> None:
        """Send the hello again if no welcome came; notice a service gone silent."""
        if self.connecting and now - self._hello_at >= HELLO_AGAIN:
            self._send_hello(now)
        elif self.session and now - self.last_heard > self._allowed_silence():
            self._lose(f"no word from the service for {now - self.last_heard:.0f} s")

    def _opened(self, msg: Welcome, carrier: zmq.Frame) -> None:
        try:  # the process that answered, on this very connection: not a name, looked up again
            self.peer = check_listener(self.endpoint, _sender(carrier))
        except ValueError as exc:
            raise ServiceError(str(exc)) from None
        resumed = bool(self._resuming) and msg.token == self._resuming
        if resumed:
            self._inbox.extendleft(reversed(self._kept))  # taken before anything after the welcome
        else:  # a new session: leases of the old one died with it
            self.incarnation += 1
            self.arrivals.dropped_payloads()
            self.payloads.clear()
            self.arrivals = Arrivals(msg.credits)
        self._kept = deque()
        self.session, self.token = msg.session, msg.token
        self.heartbeat_interval = msg.heartbeat_interval
        self._silence_limit = max(SILENCE_HEARTBEATS * msg.heartbeat_interval, 3.0)
        self.last_heard = time.monotonic()
        self._heartbeats.beat(self, self.endpoint, self.token, msg.heartbeat_interval, self._keys)
        self.events.append((SessionEvent.RESUMED if resumed else SessionEvent.OPENED, msg))

    def _lose(self, why: str) -> None:
        """The session is lost (the service restarted or went silent): the owner reconnects."""
        self._heartbeats.stop(self)
        self.session = ""
        self.events.append((SessionEvent.LOST, why))

    def ack(self, held: tuple[int, ...]) -> bool:
        """Tell the service what arrived (NOTE [ Acknowledged delivery ]); ``held``: the leases up to
        ``arrivals.have`` the loop has not released. False when the socket refused it."""
        arrivals = self.arrivals
        sent = self.send(Ack(arrivals.have, arrivals.missing()[:MAX_RELEASES], held[:MAX_RELEASES]))
        if sent:
            arrivals.ack_due = False
        return sent

    def waiting_leases(self) -> tuple[int, ...]:
        """Leases that arrived in order but that the loop has not taken yet."""
        return tuple(msg.lease for msg in self._inbox if isinstance(msg, BatchReady))

    def send(self, msg: Message) -> bool:
        """Queue ``msg`` without blocking; False when the socket refused it (full, or no session)."""
        if self.sock is None or not self.session:
            return False
        if isinstance(msg, (Start, Want, Release, Ack, Spoiled, Bye)):
            msg = replace(msg, token=self.token)
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not send %s: %s", msg.KIND, exc)
            return False
        return True

    def next_message(self) -> Message | None:
        """The next message of the open session, in order, or None."""
        return self._inbox.popleft() if self.session and self._inbox else None

    def read(self) -> None:
        """Take in whatever has arrived. Raises ServiceError if the service refused this trainer.

        Everything available is read, so that a fatal error (eviction, refusal) queued behind
        batches is raised now, instead of handing out batches the service disowned.
        """
        if self.sock is None:
            return
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.session and self.peer is not None and (sender := _sender(parts[0])) != self.peer:
                # NOTE [ A service's identity ]: libzmq reconnected this socket to another process.
                self._inbox.clear()
                self._lose(
                    f"{_who(sender)} answers there now, not pid {self.peer.pid} that opened the session"
                )
                return
            try:
                msg = decode(parts[0].bytes, SERVICE_MESSAGES)
            except ProtocolError as exc:
                raise ServiceError(f"malformed message from the service: {exc}") from None
            self.last_heard = time.monotonic()
            if not isinstance(msg, ErrorReply):
                self._arrived(msg, parts)
            elif msg.code == "no-session" and self.session:
                self._inbox.clear()
                self._lose("the service no longer knows this session (it restarted)")
                return
            elif msg.fatal or not self.session:
                # The session is over: stop keeping it alive, even if the loader is never closed.
                self._heartbeats.stop(self)
                raise ServiceError(
                    f"service at {self.endpoint} refused: {printable(msg.message)} ({printable(msg.code)})"
                )
            else:
                log.warning(
                    "service at %s reported: %s (%s)",
                    self.endpoint,
                    printable(msg.message),
                    printable(msg.code),
                )

    def _arrived(self, msg: Message, parts: list[zmq.Frame]) -> None:
        """Pass ``msg`` (``parts[0]``, its bytes after it) on in the order the service sent it (NOTE
        [ Acknowledged delivery ])."""
        frames = parts[1:]
        # fields and indices, then an encoded-row table and its bytes (NOTE [ Encoded rows ])
        if frames and (not isinstance(msg, BatchReady) or not 2 <= len(frames) <= MAX_FIELDS + 3):
            raise ServiceError(
                f"malformed message from the service: {msg.KIND} with {len(frames)} extra frames"
            )
        if isinstance(msg, Welcome):
            if self.connecting:
                self._opened(msg, parts[0])
            return  # else a repeated hello's second welcome: the session is settled
        if not self.session:
            return  # what a lost session's service still sends: its next session starts afresh
        if isinstance(msg, Heartbeat):
            self.arrivals.heartbeat(msg.sent)
            self.service_run, self.heard_run_at = msg.run, time.monotonic()
            return
        try:
            if isinstance(msg, BatchReady):
                ready = self.arrivals.batch(msg, frames or None)
            else:
                ready = self.arrivals.other(msg)
        except OverflowError as exc:
            raise ServiceError(f"malformed message from the service: {exc}") from None
        for item, payload in ready:
            if isinstance(item, BatchReady) and payload is not None:
                self.payloads[item.lease] = payload
            self._inbox.append(item)

    def _allowed_silence(self) -> float:
        return max(self._silence_limit, self.batch_bytes / SLOWEST_LINK)

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.apply(sock)
        return sock

    def _close_session(self, linger_ms: int = 0) -> None:
        self._heartbeats.stop(self)
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None
        self.session = ""

    def close(self) -> threading.Thread:
        """End the connection without blocking; the thread returned ends its context.

        An open session's socket lingers up to ``BYE_LINGER_MS``, so that a ``bye`` just sent
        reaches the service, which frees this trainer's slots now rather than after its heartbeat
        timeout; a socket that never opened a session (a hello a silent address never took) has
        nothing worth delivering and lingers not at all. The context's end, which waits out the
        linger, runs on the thread returned: join it to wait for the bye, or let it go.
        """
        self._close_session(linger_ms=BYE_LINGER_MS if self.session else 0)
        self._inbox.clear()
        self.payloads.clear()
        self.arrivals.dropped_payloads()
        ending = threading.Thread(target=self._ctx.term, name="dataferry-close", daemon=True)
        ending.start()
        return ending


def make_hello(**fields: Any) -> Hello:
    return Hello(client=f"{socket.gethostname()}:{os.getpid()}"[:128], pid=os.getpid(), **fields)


def _who(peer: Credentials | None) -> str:
    return "a process without credentials" if peer is None else f"pid {peer.pid} of uid {peer.uid}"


def _sender(frame: zmq.Frame) -> Credentials | None:
    """The credentials of the process that sent ``frame`` over an ipc connection (NOTE [ A service's
    identity ]); None where libzmq has none for it."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return peer_credentials(address) if isinstance(address, str) else None
