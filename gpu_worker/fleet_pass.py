"""Which service of a fleet decodes which batch of a pass, and the order the loop gets them in.

Pure bookkeeping, no sockets: ``gpu_worker.passes`` feeds it what arrived and sends what it assigns.

NOTE [ A fleet ]
    A trainer may be fed by several services with the same data (``ServiceLoader([...])``). The
    epoch plan is a pure function of (seed, epoch, rank, world_size, remainder), so any of them can
    decode any batch of the trainer's share, and no central dispatcher (a process that hands the
    batches out) is needed; the trainer's own ``FleetPass`` shares them:

    * Every service must serve the same feed: dataset fingerprint, seed, batch size, image size,
      transform and fields, and make its samples alike (``FeedInfo.decoding``: resize filter, DCT
      scaling, file limits), as the first endpoint given that answers does. One that differs is
      refused at attach, with every difference named; one that comes back different later is
      left out, and its batches go to the others.
    * Each service runs a *picked* run (``Start.picked``): it decodes only the batches the trainer
      names, the lowest first. The trainer names a batch to a service only while that service has
      a free credit (its credits minus batches it owes, batches waiting here, and batches the loop
      holds), so a service never has more out than its credits and a slow one is never sent more
      than it can do.
    * Among services with a free credit, the next batch (lowest seq not yet assigned) goes to the
      one expected to deliver it first, ``(owed + 1) * pace``, where ``pace`` is the service's
      measured seconds per batch. It goes nowhere yet if even that one would deliver it after the
      ``horizon``: the time the loop could need it at the earliest (when the last batch owed now
      has arrived, plus one batch of the fastest service); a faster service will have a credit
      free before then. So a straggler receives a batch only when it can deliver it in time, and
      never holds the others back; until a service has delivered once, its pace is a guess and it
      is given at most ``TRIAL`` batches.
    * Batches reach the loop in plan order, each once: what arrives early waits here (bounded by
      the credits); a second copy of a batch (after a reassignment) is released unread.
    * The batch the loop waits for, owed by a service that will deliver it more than
      ``BACKUP_MARGIN`` times later than another with a free credit would, and over
      ``BACKUP_FLOOR`` seconds from now (a straggler's trial
      batch, a service that slowed down), is asked of that other one too, once (``_backup``): the
      first copy to arrive is the loop's. A service decodes the lowest seq it was asked for first
      (``Stream.picks``), so the backup costs that one a batch time, not its whole queue. The
      owner's time left is what its pace says of the batches it owes up to that one, counted
      from its last delivery; past that, or while its pace is unknown, as long again as it has
      taken. Without this a straggler's two trial batches held the loop up for five
      batch times at every pass's start, and its last batch at every pass's end.
    * A service that misses its heartbeats, or restarted, loses its unfinished batches to the
      others (``lost``); they go out first, since the loop waits for the lowest. If it comes back
      having kept its session, what it still delivers of them arrives as second copies.
    * Progress never waits on credits held by batches waiting here: when the batch the loop needs is
      unassigned and no service has a free credit, the latest waiting batch is let go unread and
      assigned again later (``make_room``).
    A fleet of one service runs the same picked runs. A checkpoint (``state_dict``) names the
    trainer's position in the plan, not the services, so it resumes on any fleet with the same data.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")
ServiceT = TypeVar("ServiceT", bound=Hashable)
TRIAL = 2
"""Batches a service of a fleet is given before its pace is known."""
PACE_WEIGHT = 0.3
"""Weight of the newest sample in a service's pace (an exponential moving average)."""
BACKUP_MARGIN = 2.0
"""How many times later than another service a batch's owner must be expected to deliver the batch
the loop waits for before that other one is asked for it too (NOTE [ A fleet ])."""
BACKUP_FLOOR = 1.0
"""Seconds a batch's owner may still take before a second service is asked for it, at least: a
service's first batch of a pass is slower than its pace (a fresh connection, cold caches), and a
backup decodes a batch twice. Below a second of the loop's wait that is not worth it; with fast
batches the margin alone fired at every pass's start and left services of a fleet no share."""


@dataclass
class Pace:
    """A service's seconds per batch, measured from its deliveries."""

    seconds: float | None = None
    last_arrival: float | None = None

    def update(self, now: float, busy_since: float) -> None:
        """A batch arrived at ``now``; the service has been working on it since ``busy_since``."""
        start = busy_since if self.last_arrival is None else max(busy_since, self.last_arrival)
        sample = max(now - start, 1e-6)
        self.seconds = (
            sample if self.seconds is None else (1 - PACE_WEIGHT) * self.seconds + PACE_WEIGHT * sample
        )
        self.last_arrival = now


@dataclass
class FleetPass(Generic[ServiceT, ItemT]):
    """One pass over batches ``[position, end)`` of a trainer's share, across a fleet."""

    position: int
    end: int
    reassigned: int = 0
    """Batches taken from a lost service and assigned again."""
    backups: int = 0
    """Batches the loop waited for, asked of a second service too (NOTE [ A fleet ])."""
    _backed: set[int] = field(default_factory=set)
    _next_fresh: int = -1
    _returned: list[int] = field(default_factory=list)
    """A heap of seqs given back by lost services, assigned before fresh ones."""
    _owner: dict[int, ServiceT] = field(default_factory=dict)
    """seq -> the service it is assigned to, until it arrives from anyone."""
    _assigned_at: dict[tuple[ServiceT, int], float] = field(default_factory=dict)
    _owed: dict[ServiceT, set[int]] = field(default_factory=dict)
    """What each service will still deliver (it counts against its credits until it arrives)."""
    _ready: dict[int, tuple[ServiceT, ItemT]] = field(default_factory=dict)
    _paces: dict[ServiceT, Pace] = field(default_factory=dict)
    """Shared with the loader's later passes: a service's pace outlives a pass."""
    _live: set[ServiceT] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._next_fresh = self.position

    # --- services -------------------------------------------------------------------------------

    def joined(self, service: ServiceT) -> None:
        """A service can take batches (it attached, or came back)."""
        self._live.add(service)
        self._owed.setdefault(service, set())
        self._paces.setdefault(service, Pace())

    def lost(self, service: ServiceT) -> list[int]:
        """A service stopped answering: its unfinished batches go to the others. Returns them."""
        self._live.discard(service)
        self._owed.setdefault(service, set())  # it may never have joined this pass
        gone = sorted(seq for seq, owner in self._owner.items() if owner == service)
        for seq in gone:
            del self._owner[seq]
            heapq.heappush(self._returned, seq)
        self.reassigned += len(gone)
        self._paces.setdefault(service, Pace()).seconds = None  # it may come back at another speed
        return gone

    def forget(self, service: ServiceT) -> None:
        """The service no longer knows this trainer (a new session): it owes nothing any more."""
        self.lost(service)
        self._owed[service] = set()
        self._assigned_at = {key: t for key, t in self._assigned_at.items() if key[0] != service}

    def drop_waiting(self, service: ServiceT) -> list[ItemT]:
        """Forget what arrived from ``service`` and waits for the loop (its session is gone, and its
        pool with it): those batches are assigned again. The caller lets the items go."""
        seqs = [seq for seq, (owner, _) in self._ready.items() if owner == service]
        for seq in seqs:
            heapq.heappush(self._returned, seq)
        return [self._ready.pop(seq)[1] for seq in seqs]

    def owed(self, service: ServiceT) -> set[int]:
        return self._owed.get(service, set())

    def waiting(self, service: ServiceT) -> list[ItemT]:
        """Items that arrived from ``service`` and wait for the loop."""
        return [item for owner, item in self._ready.values() if owner == service]

    # --- assigning ------------------------------------------------------------------------------

    def assign(self, free: dict[ServiceT, int], now: float) -> dict[ServiceT, list[int]]:
        """Give out batches to services with a free credit (NOTE [ A fleet ]); ``free`` is updated."""
        out: dict[ServiceT, list[int]] = {}
        self._backup(free, now, out)  # the batch the loop waits for comes before new ones
        while (seq := self._peek()) is not None:
            service = self._choose(free, urgent=seq == self.position)
            if service is None:
                break
            self._pop()
            free[service] -= 1
            self._owner[seq] = service
            self._owed[service].add(seq)
            self._assigned_at[(service, seq)] = now
            out.setdefault(service, []).append(seq)
        return out

    def _backup(self, free: dict[ServiceT, int], now: float, out: dict[ServiceT, list[int]]) -> None:
        """Ask a second service for the batch the loop waits for, where its owner is far behind
        (NOTE [ A fleet ])."""
        seq = self.position
        owner = self._owner.get(seq)
        if owner is None or seq in self._ready or seq in self._backed:
            return
        others = [
            s for s in self._live if s != owner and free.get(s, 0) > 0 and self._paces[s].seconds is not None
        ]
        if not others:
            return
        # A service decodes the lowest seq it was asked for first, so a backup costs one batch time.
        best = min(others, key=self._pace)
        if self._remaining(owner, seq, now) <= max(BACKUP_MARGIN * self._pace(best), BACKUP_FLOOR):
            return
        free[best] -= 1
        self._owed[best].add(seq)
        self._assigned_at[(best, seq)] = now
        out.setdefault(best, []).append(seq)
        self._backed.add(seq)
        self.backups += 1

    def _remaining(self, service: ServiceT, seq: int, now: float) -> float:
        """How long ``service`` may still take to deliver ``seq``, counted from when it last
        delivered (or was asked, if later): what its pace says is left of the batches it owes up
        to ``seq``; past that, or with no pace known, as long again as it has taken so far."""
        pace = self._paces[service]
        since = self._assigned_at.get((service, seq), now)
        if pace.last_arrival is not None:
            since = max(since, pace.last_arrival)
        if pace.seconds is not None:
            ahead = sum(1 for s in self._owed.get(service, ()) if s <= seq)
            left = since + ahead * pace.seconds - now
            if left > 0:
                return left
        return now - since

    def _choose(self, free: dict[ServiceT, int], urgent: bool) -> ServiceT | None:
        """The service expected to deliver a new batch first, if it is worth giving it one now.

        Until a service has delivered once, its pace is a guess: in a fleet it is given at most
        ``TRIAL`` batches, so a straggler shows itself before it holds a whole window."""
        alone = len(self._live) == 1
        candidates = [
            s
            for s in self._live
            if free.get(s, 0) > 0
            and (alone or self._paces[s].seconds is not None or len(self._owed[s]) < TRIAL)
        ]
        if not candidates:
            return None
        best = min(candidates, key=self._expected)
        if urgent or self._expected(best) <= self._horizon():
            return best
        return None

    def _pace(self, service: ServiceT) -> float:
        known = [p.seconds for p in self._paces.values() if p.seconds is not None]
        own = self._paces[service].seconds
        return own if own is not None else (min(known) if known else 1.0)

    def _expected(self, service: ServiceT) -> float:
        return (len(self._owed[service]) + 1) * self._pace(service)

    def _horizon(self) -> float:
        """The earliest the loop can need a batch assigned now: once the last of the batches owed
        (all before it in the plan) has arrived, plus one batch of the fastest service."""
        live = self._live
        latest = max((len(self._owed[s]) * self._pace(s) for s in live), default=0.0)
        return latest + min((self._pace(s) for s in live), default=0.0)

    def _peek(self) -> int | None:
        while self._returned and (self._returned[0] in self._ready or self._returned[0] < self.position):
            heapq.heappop(self._returned)
        if self._returned:
            return self._returned[0]
        while self._next_fresh < self.end and self._next_fresh in self._ready:
            self._next_fresh += 1
        return self._next_fresh if self._next_fresh < self.end else None

    def _pop(self) -> None:
        if self._returned:
            heapq.heappop(self._returned)
        else:
            self._next_fresh += 1

    # --- arriving -------------------------------------------------------------------------------

    def arrived(self, service: ServiceT, seq: int, item: ItemT, now: float) -> bool:
        """Take batch ``seq`` from ``service``; False for one the loop must not see (a second copy,
        or one outside the pass): the caller lets it go unread."""
        owed = self._owed.setdefault(service, set())
        was_owed = seq in owed
        owed.discard(seq)
        assigned_at = self._assigned_at.pop((service, seq), None)
        if was_owed and assigned_at is not None:
            self._paces.setdefault(service, Pace()).update(now, assigned_at)
        if not self.position <= seq < self.end or seq in self._ready:
            return False
        self._owner.pop(seq, None)
        self._ready[seq] = (service, item)
        return True

    def take(self) -> tuple[ServiceT, ItemT] | None:
        """The batch the loop needs next, if it is here."""
        got = self._ready.pop(self.position, None)
        if got is not None:
            self.position += 1
        return got

    def make_room(self, free: dict[ServiceT, int]) -> tuple[ServiceT, ItemT] | None:
        """When the batch the loop needs is unassigned and no live service has a free credit, let the
        latest waiting batch of a live service go, to be assigned again. The caller releases it."""
        if self._peek() != self.position or any(free.get(s, 0) > 0 for s in self._live):
            return None
        waiting = [
            seq for seq, (owner, _) in self._ready.items() if owner in self._live and seq > self.position
        ]
        if not waiting:
            return None
        seq = max(waiting)
        got = self._ready.pop(seq)
        heapq.heappush(self._returned, seq)
        return got

    @property
    def done(self) -> bool:
        return self.position >= self.end

    def drain(self) -> list[tuple[ServiceT, ItemT]]:
        """Everything still waiting (the pass ends early): the caller lets it go."""
        items = list(self._ready.values())
        self._ready.clear()
        return items
