"""What the service announced, put back in order: each lease once, gaps found and asked for again.

NOTE [ Acknowledged delivery ]
    ZeroMQ reconnects a TCP connection that a reset, a NAT or a load balancer killed, under the same
    routing id and without a word; whatever was queued on the dead connection is gone. "Sent" is
    therefore never "received", and the service learns what the trainer really got from the trainer:

    * The service numbers a session's leases 1, 2, 3, ... in the order it announces them, taking a
      number only when the announcement went out (no holes). On one connection messages arrive in
      the order they were sent, so a lease that arrives after a missing one, or a service heartbeat
      saying ``sent=N`` that arrives before lease N, proves the missing announcements were lost.
    * The trainer hands batches to its loop in lease order: what arrives after a gap waits here
      (at most ``credits`` batches: the service never has more out) until the gap is filled. An
      announcement that arrives twice is dropped, its bytes with it, so nothing is delivered twice.
    * Its ``ack`` says ``have`` (it has every lease up to it), ``missing`` (leases after ``have`` it
      knows were sent and not received: the service announces them again, same lease, same slot,
      at most once per heartbeat interval each) and ``held`` (leases up to ``have`` for which it
      has not sent a release). Sent on the socket its releases use, after them, so a lease up to
      ``have`` that is not ``held`` and that the service still counts was released and the release
      was lost: the service frees it, and the credit comes back. Acks go with every service
      heartbeat the trainer reads while it waits, and at once when a gap is found.
    * A start whose run the service's heartbeats do not show after a heartbeat interval is sent
      again; the service ignores a start of the run it already serves.
    * A resumed session (NOTE [ Reconnecting ]) names ``have`` and ``held`` in its hello, and the
      service announces again everything after ``have``: the same rules, for a lost connection.
    So nothing the service announced is lost or doubled and no credit leaks, in either direction,
    as long as the session lives; when it does not (a stall longer than the client timeout), the
    trainer starts a new session at its position, as after a service restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocol.messages import BatchReady, Message

Payload = TypeVar("Payload")


@dataclass
class Arrivals(Generic[Payload]):
    """One session's announcements, in lease order. ``limit``: the credits granted (a service that
    keeps its promise never has more announcements out beyond ``have``)."""

    limit: int
    have: int = 0
    """Every lease up to this one has arrived (and been passed on)."""
    known_sent: int = 0
    """The last lease the service is known to have announced."""
    ack_due: bool = False
    """Something to tell the service: a gap was found, or a heartbeat asks for an acknowledgement."""
    _early: dict[int, tuple[BatchReady, Payload]] = field(default_factory=dict)
    _behind: list[tuple[int, Message]] = field(default_factory=list)
    """Other messages that came after lease ``n`` while a gap was open: (n, message)."""

    def batch(self, msg: BatchReady, payload: Payload) -> list[tuple[Message, Payload | None]]:
        """Take an announcement; return what may now be passed on, in order ([] for a duplicate)."""
        lease = msg.lease
        if lease <= self.have or lease in self._early:
            return []
        self._saw(lease)
        self._early[lease] = (msg, payload)
        if lease != self.have + 1:
            self.ack_due = True  # a gap: ask for what is missing now
        return self._in_order()

    def other(self, msg: Message) -> list[tuple[Message, Payload | None]]:
        """Take an ``end`` (or any non-batch message sent in sequence with the batches): it waits
        for every announcement known to have been sent before it, even when none came after the gap."""
        after = max(self.known_sent, max(self._early, default=0))
        if after <= self.have:
            return [(msg, None)]
        self._behind.append((after, msg))
        return []

    def heartbeat(self, sent: int) -> None:
        """The service had announced up to ``sent`` when it sent this heartbeat."""
        self._saw(sent)
        self.ack_due = True

    @property
    def early(self) -> int:
        """Announcements that arrived after a gap and wait for it to be filled."""
        return len(self._early)

    def missing(self) -> tuple[int, ...]:
        """Leases announced after ``have`` that have not arrived."""
        return tuple(n for n in range(self.have + 1, self.known_sent + 1) if n not in self._early)

    def dropped_payloads(self) -> list[Payload]:
        """Forget what waits behind a gap (a new session); its payloads, for the caller to free."""
        payloads = [payload for _, payload in self._early.values()]
        self._early.clear()
        self._behind.clear()
        return payloads

    def _saw(self, lease: int) -> None:
        if lease - self.have > self.limit:
            raise OverflowError(
                f"the service announced lease {lease} while {self.have} is the last one received: "
                f"more than the {self.limit} credits granted"
            )
        self.known_sent = max(self.known_sent, lease)

    def _in_order(self) -> list[tuple[Message, Payload | None]]:
        out: list[tuple[Message, Payload | None]] = []
        while self.have + 1 in self._early:
            self.have += 1
            msg, payload = self._early.pop(self.have)
            out.append((msg, payload))
            while self._behind and self._behind[0][0] <= self.have:
                out.append((self._behind.pop(0)[1], None))
        return out
