"""Batches on their way to remote trainers: copies that ZeroMQ still holds, bounded, and who is stuck.

NOTE [ Remote sends ]
    A ROUTER socket cannot take a message back from one peer, nor close one peer's connection: what
    it queued for a peer that stops reading (a paused process, a hostile one) stays queued for as
    long as that connection lives. So a slot is never lent to ZeroMQ: a remote trainer's batch is
    copied out of the slot and the copy is sent (``send_copied``); the slot goes back to the pool
    on release as for a local trainer, and no peer can keep one out of the pool beyond its credits
    and its session. What the copies cost is memory, bounded here:
    * per session: at most ``credits`` batches being sent (an announcement sent again waits until
      its earlier copy is done);
    * in all: ``limit`` bytes (what every feed's pool may grow to); past it, announcements wait (NOTE
      [ Owed messages ]) until ZeroMQ lets copies go;
    * a session whose oldest copy has not gone out within the client timeout has stopped reading:
      it is dropped and its slots return (``TrainerDesk.expire`` in trainers/desk.py);
    * the copies of a session that ended, or resumed on a new connection, are orphans: they no
      longer count against that session or keep the others from ``limit``, and go when ZeroMQ lets
      them go, which is when their connection closes: at once when the peer's process ends, after
      the kernel's retransmission timeout (about 15 minutes) for a network path that died, and
      never for a peer that keeps its connection open and does not read. ZMTP heartbeats do not
      help: their PING waits behind the copies in the full socket buffer (tried: a paused trainer's
      connection stayed open with them). So that is memory only an authorised peer can hold, at
      most ``credits`` batches per session it opens (``status``: ``remote_send_bytes``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import zmq

Socket = zmq.Socket[bytes]


class Send(Protocol):
    """A send in progress (a ZeroMQ ``MessageTracker``)."""

    @property
    def done(self) -> bool: ...


@dataclass
class CopiedSend:
    """A batch sent as copies: done once ZeroMQ holds none of them, then its buffers are reused."""

    tracker: zmq.MessageTracker
    buffers: list[bytearray]

    @property
    def done(self) -> bool:
        return bool(self.tracker.done)


@dataclass
class _Copy:
    send: Send
    nbytes: int
    at: float


@dataclass
class SendBudget:
    limit: int
    """Bytes of copies ZeroMQ may hold for remote trainers at once."""
    _copies: dict[str, deque[_Copy]] = field(default_factory=dict)
    held: int = 0
    """Bytes ZeroMQ holds now, for live sessions."""
    _orphans: list[_Copy] = field(default_factory=list)
    """Copies of sessions that ended or moved to another connection: still held by ZeroMQ (until
    their connection closes), no longer anyone's to wait for."""
    orphaned: int = 0
    _spare: list[bytearray] = field(default_factory=list)
    """Buffers ZeroMQ is done with, kept for the next copies: a fresh one of a batch's size costs
    its page faults again on every batch (measured: about half of what copying costs)."""

    def settle(self) -> None:
        """Forget copies ZeroMQ has finished with, keeping their buffers for reuse."""
        for session_id, copies in list(self._copies.items()):
            while copies and copies[0].send.done:
                done = copies.popleft()
                self.held -= done.nbytes
                self._reuse(done)
            if not copies:
                del self._copies[session_id]
        for done in [c for c in self._orphans if c.send.done]:
            self._orphans.remove(done)
            self.orphaned -= done.nbytes
            self._reuse(done)

    def orphan(self, session_id: str) -> None:
        """The session ended or resumed on another connection: its copies on the old one no longer
        count against it (nor make it look stuck), nor against the other sessions' room."""
        copies = self._copies.pop(session_id, None)
        if copies:
            self._orphans.extend(copies)
            moved = sum(c.nbytes for c in copies)
            self.held -= moved
            self.orphaned += moved

    def _reuse(self, done: _Copy) -> None:
        if isinstance(done.send, CopiedSend):
            self.give_back(done.send.buffers)

    def buffer(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes``: a spare one if any fits, else a new one."""
        for i, spare in enumerate(self._spare):
            if len(spare) >= nbytes:
                return self._spare.pop(i)
        return bytearray(nbytes)

    def give_back(self, buffers: list[bytearray]) -> None:
        """Buffers ZeroMQ holds no more, for the next copies."""
        self._spare.extend(buffers)
        spare = sum(len(b) for b in self._spare)
        while self._spare and spare > self.limit:  # never more spare than may be in flight
            spare -= len(self._spare.pop(0))

    def room(self, session_id: str, nbytes: int, credits: int) -> bool:
        """May another copy of ``nbytes`` go to this session now?"""
        self.settle()
        mine = self._copies.get(session_id, ())
        return len(mine) < credits and (self.held + nbytes <= self.limit or not self.held)

    def add(self, session_id: str, send: Send, nbytes: int) -> None:
        self._copies.setdefault(session_id, deque()).append(_Copy(send, nbytes, time.monotonic()))
        self.held += nbytes

    def stuck_since(self, session_id: str) -> float | None:
        """When the session's oldest unfinished copy was sent, or None if it has none; ``settle``
        first, or a copy that went out since the last send still counts."""
        copies = self._copies.get(session_id)
        return copies[0].at if copies else None


def send_copied(
    sock: Socket, routing_id: bytes, header: bytes, views: list[memoryview], budget: SendBudget
) -> CopiedSend:
    """Send ``header`` then copies of ``views`` (a slot's fields and indices) without blocking.

    The send is done once ZeroMQ holds none of the copies any more (NOTE [ Remote sends ]). Large
    copies go into ``budget``'s buffers and are handed to ZeroMQ without a second copy, each as a
    tracked frame of its own: pyzmq's ``send_multipart(track=True)`` would track only the last part.
    """
    parts: list[bytes | zmq.Frame] = [routing_id, header]
    buffers: list[bytearray] = []
    for view in views:
        n = len(view)
        if n < zmq.COPY_THRESHOLD:  # ZeroMQ copies small frames itself anyway
            parts.append(bytes(view))
            continue
        buf = budget.buffer(n)
        buf[:n] = view
        buffers.append(buf)
        parts.append(zmq.Frame(memoryview(buf)[:n], copy=False, track=True))
    trackers = [part.tracker for part in parts if isinstance(part, zmq.Frame) and part.tracker is not None]
    try:
        sock.send_multipart(parts, zmq.NOBLOCK)
    except zmq.ZMQError:
        del parts[:]
        budget.give_back(buffers)  # nothing went out: ZeroMQ holds none of them
        raise
    return CopiedSend(zmq.MessageTracker(*trackers), buffers)
