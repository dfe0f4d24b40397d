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
    * in all: ``limit`` bytes (the size of every feed's pool); past it, announcements wait (NOTE
      [ Owed messages ]) until ZeroMQ lets copies go;
    * a session whose oldest copy has not gone out within the client timeout has stopped reading:
      it is dropped and its slots return (trainers.py ``expire``). Its copies still count until
      its connection closes: that is memory only an authorised peer can hold, within ``limit``.
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
class _Copy:
    tracker: Send
    nbytes: int
    at: float


@dataclass
class SendBudget:
    limit: int
    """Bytes of copies ZeroMQ may hold for remote trainers at once."""
    _copies: dict[str, deque[_Copy]] = field(default_factory=dict)
    held: int = 0
    """Bytes ZeroMQ holds now."""

    def settle(self) -> None:
        """Forget copies ZeroMQ has finished with."""
        for session_id, copies in list(self._copies.items()):
            while copies and copies[0].tracker.done:
                self.held -= copies.popleft().nbytes
            if not copies:
                del self._copies[session_id]

    def room(self, session_id: str, nbytes: int, credits: int) -> bool:
        """May another copy of ``nbytes`` go to this session now?"""
        self.settle()
        mine = self._copies.get(session_id, ())
        return len(mine) < credits and (self.held + nbytes <= self.limit or not self.held)

    def add(self, session_id: str, tracker: Send, nbytes: int) -> None:
        self._copies.setdefault(session_id, deque()).append(_Copy(tracker, nbytes, time.monotonic()))
        self.held += nbytes

    def stuck_since(self, session_id: str) -> float | None:
        """When the session's oldest unfinished copy was sent, or None if it has none."""
        copies = self._copies.get(session_id)
        return copies[0].at if copies else None


def send_copied(
    sock: Socket, routing_id: bytes, header: bytes, views: list[memoryview]
) -> zmq.MessageTracker:
    """Send ``header`` then copies of ``views`` (a slot's fields and indices) without blocking.

    The returned tracker is done once ZeroMQ holds none of the copies any more (NOTE [ Remote
    sends ]). Large copies are handed to ZeroMQ without a second copy, each as a tracked frame of
    its own: pyzmq's ``send_multipart(track=True)`` would track only the last part.
    """
    parts: list[bytes | zmq.Frame] = [routing_id, header]
    for view in views:
        copied = bytes(view)
        parts.append(
            zmq.Frame(copied, copy=False, track=True) if len(copied) >= zmq.COPY_THRESHOLD else copied
        )
    trackers = [part.tracker for part in parts if isinstance(part, zmq.Frame) and part.tracker is not None]
    sock.send_multipart(parts, zmq.NOBLOCK)
    return zmq.MessageTracker(*trackers)
