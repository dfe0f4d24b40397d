"""A trainer's session with the service: sockets, hello/welcome, heartbeats, and noticing loss.

The iterating thread owns the main socket. A daemon thread owns a second socket and only sends
heartbeats carrying the session's token, so a long training step never looks like a dead trainer.
Every ``open`` makes a fresh socket (new routing id), so nothing queued for a previous service
instance is ever delivered to the next one. Every session message carries the token the welcome
gave (``send`` adds it). A ``batch`` for a trainer on another host arrives with its bytes as more
frames, one per field and one for the indices; they wait in ``payloads`` until the loader takes them
with the batch, which checks them against the feed's layout. Announcements pass through
``gpu_worker.arrivals`` first, which hands them on in lease order, each once, and finds the ones a
lost connection swallowed (NOTE [ Acknowledged delivery ]).
"""

from __future__ import annotations

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
from gpu_worker.curve import ClientKeys
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
    Start,
    Welcome,
    decode,
    encode,
)

log = logging.getLogger(__name__)
SERVICE_MESSAGES = (Welcome, BatchReady, EpochEnd, Heartbeat, ErrorReply)
POLL_SLICE = 0.1
BYE_LINGER_MS = 500
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


class SessionLost(Exception):
    """The service restarted (it no longer knows the session) or has gone silent: reconnect."""


class Connection:
    def __init__(self, endpoint: str, hello: Hello, keys: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self._hello = hello
        self._keys = keys
        self.token = ""
        self.payloads: dict[int, list[zmq.Frame]] = {}
        """Lease -> the frames that came with its batch: its fields', then its indices (TCP transport)."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._inbox: deque[Message] = deque()
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.session = ""
        self.generation = 0
        self.resumed = False
        self.last_heard = time.monotonic()
        self._silence_limit = float("inf")
        self.batch_bytes = 0
        """Bytes one batch brings over the socket (TCP transport), which stretch the silence allowed."""
        self._lost: str | None = None
        self.arrivals: Arrivals[list[zmq.Frame] | None] = Arrivals(MAX_CREDITS)
        self.service_run = -1
        """The run the service's last heartbeat said it serves this session."""
        self.heard_run_at = 0.0
        self.heartbeat_interval = 1.0

    def open(self, deadline: float, give_up: str, held: tuple[int, ...] = ()) -> Welcome:
        """Start a session, or take the last one back if the service still has it (``resumed``);
        raise ServiceTimeout with ``give_up`` if none is had by ``deadline``.

        A resumed session keeps what had arrived and not yet been taken (NOTE [ Acknowledged
        delivery ]): the hello names ``held`` and ``have``, and the service frees and announces
        again accordingly. A new one starts from nothing: the old leases died with the old session.
        """
        previous = self.token
        kept = self._inbox
        self._inbox = deque()
        self._close_session()
        sock = self._sock = self._socket()
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        sock.connect(self.endpoint)
        have = self.arrivals.have if previous else 0
        hello = encode(replace(self._hello, resume=previous, held=held if previous else (), have=have))
        msg = self._await_welcome(sock, hello, deadline, give_up)
        self.resumed = bool(previous) and msg.token == previous
        if self.resumed:
            self._inbox.extendleft(reversed(kept))  # taken before anything after the welcome
        else:  # a new session: leases of the old one died with it
            self.generation += 1
        self.session, self.token = msg.session, msg.token
        self.heartbeat_interval = msg.heartbeat_interval
        self._silence_limit = max(SILENCE_HEARTBEATS * msg.heartbeat_interval, 3.0)
        self._start_heartbeat(msg.heartbeat_interval)
        return msg

    def _await_welcome(self, sock: zmq.Socket[bytes], hello: bytes, deadline: float, give_up: str) -> Welcome:
        """Send ``hello`` until a welcome comes: a hello lost with a connection is sent again (the
        service welcomes a repeated hello again rather than opening a second session)."""
        while True:
            try:
                sock.send(hello, zmq.NOBLOCK)
            except zmq.Again:
                pass  # nothing to send to yet: the next round tries again
            msg = self.recv(min(deadline, time.monotonic() + HELLO_AGAIN))
            if isinstance(msg, Welcome):
                return msg
            if time.monotonic() >= deadline:
                raise ServiceTimeout(give_up)

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
        if self._sock is None:
            return False
        if isinstance(msg, (Start, Release, Ack, Bye)):
            msg = replace(msg, token=self.token)
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not send %s: %s", msg.KIND, exc)
            return False
        return True

    def recv(self, deadline: float) -> Message | None:
        """The next message, or None at ``deadline``. Raises SessionLost, or ServiceError if fatal.

        Whatever else has already arrived is read too, so that a fatal error (eviction, refusal)
        queued behind batches is raised now, instead of handing out batches the service disowned.
        """
        assert self._sock is not None
        while True:
            if self._lost is not None:
                why, self._lost = self._lost, None
                raise SessionLost(why)
            if self._inbox:
                return self._inbox.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._sock.poll(int(min(remaining, POLL_SLICE) * 1000) + 1):
                self._read_available(self._sock)
            elif self.session and time.monotonic() - self.last_heard > self._allowed_silence():
                self._lost = f"no word from the service for {time.monotonic() - self.last_heard:.0f} s"

    def _read_available(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode(parts[0].bytes, SERVICE_MESSAGES)
            except ProtocolError as exc:
                raise ServiceError(f"malformed message from the service: {exc}") from None
            self.last_heard = time.monotonic()
            if not isinstance(msg, ErrorReply):
                self._arrived(msg, parts[1:])
            elif msg.code == "no-session" and self.session:
                self._lost = "the service no longer knows this session (it restarted)"
                self._inbox.clear()
                return
            elif msg.fatal or not self.session:
                # The session is over: stop keeping it alive, even if the loader is never closed.
                self._stop_heartbeat.set()
                raise ServiceError(f"service refused: {msg.message} ({msg.code})")
            else:
                log.warning("service reported: %s (%s)", msg.message, msg.code)

    def _arrived(self, msg: Message, frames: list[zmq.Frame]) -> None:
        """Pass ``msg`` on in the order the service sent it (NOTE [ Acknowledged delivery ])."""
        if frames and (not isinstance(msg, BatchReady) or not 2 <= len(frames) <= MAX_FIELDS + 1):
            raise ServiceError(
                f"malformed message from the service: {msg.KIND} with {len(frames)} extra frames"
            )
        if isinstance(msg, Welcome):
            if self.session:
                return  # a repeated hello's second welcome: the session is settled (open() returned)
            if msg.token != self.token:  # a new session: nothing of the old one's order applies
                self.arrivals.dropped_payloads()
                self.payloads.clear()
                self.arrivals = Arrivals(msg.credits)
            self._inbox.append(msg)
            return
        if isinstance(msg, Heartbeat):
            if self.session:
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

    def _start_heartbeat(self, interval: float) -> None:
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(
            target=_heartbeat_loop,
            args=(self._socket(), self.endpoint, self.token, interval, self._stop_heartbeat),
            name="dataferry-heartbeat",
            daemon=True,
        )
        self._heartbeat.start()

    def _close_session(self, linger_ms: int = 0) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(2.0)
            self._heartbeat = None
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None
        self.session = ""

    def close(self) -> None:
        # A short linger lets a final ``bye`` reach the service, so it frees this trainer's slots now
        # rather than after its heartbeat timeout; it cannot hang: the service is local or gone.
        self._close_session(linger_ms=BYE_LINGER_MS)
        self._inbox.clear()
        self.payloads.clear()
        self.arrivals.dropped_payloads()
        self._ctx.term()


def make_hello(**fields: Any) -> Hello:
    return Hello(client=f"{socket.gethostname()}:{os.getpid()}"[:128], pid=os.getpid(), **fields)


def _heartbeat_loop(
    sock: zmq.Socket[Any], endpoint: str, token: str, interval: float, stop: threading.Event
) -> None:
    sock.connect(endpoint)
    frame = encode(Heartbeat(token))
    try:
        while not stop.wait(interval):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close(linger=0)
