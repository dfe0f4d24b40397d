"""One service as the loader sees it: its connection and session, the pool it maps, the leases the
loop holds, and the share of the pass it delivered (``Fleet``, in fleet.py, owns one per endpoint)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpu_worker.batch import Batch
from gpu_worker.connection import Connection, ServiceError
from gpu_worker.delivery import Delivery
from gpu_worker.leases import LeaseBook
from protocol.messages import (
    MAX_BAD_REPORTS,
    MAX_RELEASES,
    BatchReady,
    Bye,
    FeedInfo,
    Message,
    Spoiled,
    Start,
    Want,
    Welcome,
)

log = logging.getLogger(__name__)


@dataclass
class Share:
    """What one service delivered to the loop: ``gpu-worker run`` and ``loader.stats()`` show it."""

    batches: int = 0
    images: int = 0
    first: float = 0.0
    last: float = 0.0

    def add(self, images: int, now: float) -> None:
        if not self.batches:
            self.first = now
        self.batches += 1
        self.images += images
        self.last = now

    def rate(self) -> float:
        span = self.last - self.first
        return self.images / span if span > 0 else 0.0


@dataclass(eq=False)  # one object per service, hashed by identity
class Service:
    """One service of the fleet, as this trainer sees it."""

    endpoint: str
    conn: Connection
    leases: LeaseBook
    delivery: Delivery
    credits_asked: int
    info: FeedInfo | None = None
    batches: int = 0
    """This trainer's batches per epoch, as the service's welcome says."""
    credits: int = 0
    run: int = 0
    unsent_start: Start | None = None
    last_start: tuple[Start, float] | None = None
    """The current run's start and when it went out: sent again if the service never shows it."""
    named_at: float = 0.0
    """When every batch it owes was last named to it together: again every heartbeat interval, so a
    ``want`` lost with a connection (or read before its run's start) costs at most that long."""
    refused: str = ""
    """Why this service is left out (another feed, a refusal, its address gone from its name's
    answer); '' while it is in use."""
    resume_held: tuple[int, ...] = ()
    """What the last resuming hello named as held: a resumed session keeps only those."""
    share: Share = field(default_factory=Share)
    via: str = ""
    """The endpoint naming a host this one is an address of (NOTE [ A fleet from a name ] in
    gpu_worker/names.py); '' for an endpoint given as it is."""

    @property
    def open(self) -> bool:
        return bool(self.conn.session) and not self.refused

    def adopt(self, welcome: Welcome) -> None:
        """Use a (new) session's feed and pool."""
        self.info = welcome.feed
        self.batches = welcome.batches
        self.credits = min(self.credits_asked, welcome.credits)
        self.delivery.adopt(welcome.feed, None if self.conn.peer is None else self.conn.peer.uid)
        self.conn.batch_bytes = self.delivery.batch_bytes
        self.unsent_start = self.last_start = None  # meaningless to a new session

    def in_use(self, waiting: tuple[int, ...]) -> int:
        """Credits this session's service counts as taken: leases not yet returned, announcements
        not yet taken, and the ``waiting`` leases (taken from it, waiting for the loop)."""
        unreturned = self.leases.unreturned(self.conn.incarnation)
        return unreturned + len(self.conn.waiting_leases()) + self.conn.arrivals.early + len(waiting)

    def held(self, waiting: tuple[int, ...]) -> tuple[int, ...]:
        """What a resuming hello names: leases still referenced, or arrived and not yet taken."""
        incarnation = self.conn.incarnation
        return (*self.leases.held_ids(incarnation), *self.conn.waiting_leases(), *waiting)[:MAX_RELEASES]

    def send_start(self, start: Start) -> None:
        """Send ``start``, or keep it to send again (it supersedes any start kept before)."""
        if self.conn.send(start):
            self.unsent_start, self.last_start = None, (start, time.monotonic())
        else:
            self.unsent_start = start

    def want(self, seqs: list[int]) -> bool:
        """Name batches of the current run to decode; one the socket refuses is named again later."""
        return bool(seqs) and self.conn.send(Want(self.run, tuple(seqs)))

    def send_pending(self, owed: set[int], waiting: tuple[int, ...], now: float) -> None:
        """NOTE [ Releases that could not be sent ]: the kept start first, then every release; the
        batches it owes named again once a heartbeat interval; an ack when one is due, naming as
        held the ``waiting`` leases too (taken from it, waiting for the loop)."""
        self.delivery.collect()  # device copies that have finished let their slots go
        if not self.conn.session:
            return
        self._start_again_if_lost()
        if self.unsent_start is not None:
            self.send_start(self.unsent_start)
        self.leases.flush(self.conn.incarnation, self.conn.send)
        if owed and now - self.named_at > self.conn.heartbeat_interval and self.want(sorted(owed)):
            self.named_at = now
        if self.conn.arrivals.ack_due:
            self._ack(waiting)

    def _ack(self, waiting: tuple[int, ...]) -> None:
        """NOTE [ Acknowledged delivery ]: after the releases, on the same socket."""
        have = self.conn.arrivals.have
        incarnation = self.conn.incarnation
        unreleased = (*self.leases.unreleased_ids(incarnation), *self.conn.waiting_leases(), *waiting)
        self.conn.ack(tuple(lease for lease in unreleased if lease <= have))

    def _start_again_if_lost(self) -> None:
        """A start the service's heartbeats still do not show a heartbeat interval after it went out
        was lost with a connection (NOTE [ Acknowledged delivery ]); the service ignores a repeat."""
        if self.last_start is None or self.unsent_start is not None:
            return
        start, sent_at = self.last_start
        conn = self.conn
        if conn.service_run != start.run and conn.heard_run_at - sent_at > conn.heartbeat_interval:
            log.info("%s does not show run %d started; sending its start again", self.endpoint, start.run)
            self.send_start(start)

    def messages(self) -> Iterator[tuple[int, Message]]:
        """The open session's messages, in order, each with the session incarnation it came in; one
        the caller stops before is left for the next call."""
        while (msg := self.conn.next_message()) is not None:
            yield self.conn.incarnation, msg

    @property
    def incarnation(self) -> int:
        """The session's incarnation now (a lost session's leases died with it)."""
        return self.conn.incarnation

    def silent_for(self, now: float) -> float:
        """Seconds since the service was last heard from."""
        return now - self.conn.last_heard

    def unread(self, msg: BatchReady, incarnation: int) -> None:
        """Give back a batch the loop will not see (an older run's, a second copy, or left over).
        ``incarnation``: the session it came in; one of a lost session died with it."""
        if incarnation != self.conn.incarnation:
            return
        self.delivery.forget((incarnation, msg.lease))
        self.conn.payloads.pop(msg.lease, None)
        self.leases.let_go((incarnation, msg.lease))

    def arrived(self, msg: BatchReady, incarnation: int) -> None:
        """A batch of the pass arrived: its encoded rows begin decoding now (NOTE [ Encoded rows ])."""
        if incarnation == self.conn.incarnation and msg.count > 0:
            self.delivery.prepare(msg, (incarnation, msg.lease), self.conn.payloads.get(msg.lease))

    def wrap(self, msg: BatchReady) -> Batch:
        """The loop's batch; one whose every sample was bad has no rows, and its slot is let go at
        once (NOTE [ Empty batches ] in gpu_worker/passes.py)."""
        assert self.info is not None
        lease = (self.conn.incarnation, msg.lease)
        frames = self.conn.payloads.pop(msg.lease, None)
        if msg.count > self.info.batch_size:
            self.leases.let_go(lease)
            raise ServiceError(
                f"{self.endpoint} announced {msg.count} rows in a batch of {self.info.batch_size}"
            )
        if msg.count == 0:
            self.leases.let_go(lease)
            return self.delivery.empty(msg)
        try:
            return self.delivery.wrap(msg, lease, frames)
        finally:
            self._report_spoiled()

    def _report_spoiled(self) -> None:
        """Tell the service of encoded rows this trainer could not decode: it logs and counts them."""
        spoiled = self.delivery.spoiled
        while spoiled:
            part, spoiled[:] = spoiled[:MAX_BAD_REPORTS], spoiled[MAX_BAD_REPORTS:]
            self.conn.send(Spoiled(tuple(part)))

    def close(self) -> threading.Thread:
        """Leave the service without blocking; join the thread returned to wait for the bye."""
        self.delivery.abandon_all()  # no decode thread may write into a slot the bye frees
        if self.conn.session:  # a bye frees this trainer's slots now, not after its timeout
            self.conn.send(Bye())
        ending = self.conn.close()
        self.delivery.close()
        return ending
