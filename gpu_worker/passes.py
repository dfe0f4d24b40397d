"""One pass of the loop over an epoch (or what is left of it): the pass owns its state, the loader
owns the configuration and the sessions (``gpu_worker.fleet``).

A shard pass hands its batches out across the fleet and puts them back in plan order (NOTE [ A
fleet ] in ``gpu_worker/fleet_pass.py``); a broadcast pass takes what its one service plans for the
group. Either way the loop gets each batch of the pass once, in order.

NOTE [ Empty batches ]
    A batch whose every sample was bad (unreadable files, a pipeline that raised on each) arrives
    with no rows. The ranks of a DDP job must take the same number of steps, or the first
    collective of the rank that stepped less waits for ever; so a shard pass with ``world_size``
    over 1 hands such a batch to the loop as it is: every field ``[0, *shape]``, its ``seq`` and
    ``epoch``, no indices. A loop that only wants data can skip its step; one under DDP should run
    it (a forward of zero rows and a zero loss) or all-reduce a flag first. With one rank, or in a
    broadcast group (whose members get the same batches), nothing waits on it, and it is left out
    of the loop, so a model that cannot take zero rows never sees one. ``loader.stats()["empty"]``
    counts them either way.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpu_worker.batch import Batch
from gpu_worker.connection import ServiceError, ServiceTimeout
from gpu_worker.fleet import Fleet
from gpu_worker.fleet_pass import FleetPass
from gpu_worker.service import Service
from protocol.messages import BatchReady, EpochEnd, Start

Arrived = tuple[int, BatchReady]
"""(session generation, announcement): what waits in the fleet pass."""


@dataclass
class PassSettings:
    epoch: int
    position: int
    batches: int
    timeout: float
    broadcast: bool
    empty_batches: bool = False
    """Hand the loop batches whose every sample was bad, with no rows (NOTE [ Empty batches ])."""
    offset: int = 0
    """Shard mode: positions of the epoch's order an earlier job took; this pass shares out the
    rest (NOTE [ Elastic epochs ] in protocol/shares.py)."""


class EpochPass:
    """Iterate once: ``for batch in EpochPass(...)``. ``position`` counts the batches handed out."""

    def __init__(self, fleet: Fleet, settings: PassSettings) -> None:
        self._fleet = fleet
        self._settings = settings
        self.epoch = settings.epoch
        self.position = settings.position
        self.active = False
        """Iterating: started and neither finished nor abandoned (``state_dict`` names its position)."""
        self.last_endpoint = ""
        """The endpoint of the service that delivered the batch handed out last."""
        self._fleet_pass: FleetPass[Service, Arrived] = FleetPass(
            settings.position, settings.batches, _paces=fleet.paces
        )
        self.empty = 0
        """Batches of this pass whose every sample was bad (NOTE [ Empty batches ])."""
        self._started: set[int] = set()
        """ids of the services this pass has sent a start under their current session."""

    @property
    def offset(self) -> int:
        return self._settings.offset

    @property
    def batches(self) -> int:
        return self._settings.batches

    def counts(self) -> Counter[str]:
        """What ``loader.stats()`` adds up over passes: batches assigned again after a service was
        lost, asked of a second service (backups), and with no sample left (empty)."""
        d = self._fleet_pass
        return Counter(reassigned=d.reassigned, backups=d.backups, empty=self.empty)

    def __iter__(self) -> Iterator[Batch]:
        fleet = self._fleet
        clock = fleet.clock
        self.active = True
        fleet.on_event = self._on_event
        fleet.waiting_leases = self._waiting_leases
        try:
            for service in fleet.live:
                self._fleet_pass.joined(service)
            self._begin_all()
            while self.position < self._settings.batches:
                clock.waiting()  # NOTE [ Exposed wait ]: only the pull counts as waiting
                service, msg = self._next()
                clock.computing()
                if msg is None:  # the broadcast epoch's end
                    break
                batch = service.wrap(msg)
                self.position = (msg.seq if self._settings.broadcast else self.position) + 1
                if not len(batch.indices):
                    self.empty += 1
                if len(batch.indices) or self._settings.empty_batches:
                    service.share.add(len(batch.indices), time.monotonic())
                    self.last_endpoint = service.endpoint
                    yield batch
                del batch  # the generator must not keep the previous batch's slot while waiting
            self.position = max(self.position, self._settings.batches)
            self._send_pending(time.monotonic())  # credits back now, so the next pass starts at once
        finally:
            clock.idle()
            self._leave()

    def _leave(self) -> None:
        self.active = False
        if self._fleet.on_event == self._on_event:
            self._fleet.on_event = None
        for service, (generation, msg) in self._fleet_pass.drain():
            service.unread(msg, generation)

    def _waiting_leases(self, service: Service) -> tuple[int, ...]:
        gen = service.conn.generation
        return tuple(msg.lease for g, msg in self._fleet_pass.waiting(service) if g == gen)

    # --- runs -----------------------------------------------------------------------------------

    def _begin_all(self) -> None:
        """A new run on every service; in shard mode the first batches are shared out across all of
        them at once (one at a time to the one expected first: never a block each)."""
        self._begin(self._fleet.live)

    def _begin(self, services: list[Service]) -> None:
        """A new run on ``services``: picked in shard mode, with the batches assigned to each."""
        settings = self._settings
        for service in services:
            service.run += 1
            self._started.add(id(service))
        now = time.monotonic()
        first = {} if settings.broadcast else self._assign(now, services)
        for service in services:
            transport = service.delivery.transport
            if settings.broadcast:
                service.send_start(Start(service.run, settings.epoch, self.position, transport))
                continue
            want = tuple(first.get(service, ()))
            start = Start(
                service.run, settings.epoch, self.position, transport, True, want, offset=settings.offset
            )
            service.send_start(start)
            service.named_at = now

    def _on_event(self, service: Service, what: str, detail: Any) -> None:
        """What happened to a session means for this pass's batches (NOTE [ A fleet ])."""
        fleet_pass = self._fleet_pass
        if what == "lost":
            fleet_pass.lost(service)
        elif what == "resumed":
            fleet_pass.joined(service)
            if id(service) not in self._started:  # it was lost before this pass began
                self._begin([service])
        elif what in ("refused", "opened"):
            # Left out for good, or a new session: it owes nothing, and what came from it is gone.
            for generation, msg in fleet_pass.drop_waiting(service):
                service.unread(msg, generation)
            fleet_pass.forget(service)
            if what == "opened":
                fleet_pass.joined(service)
                self._begin([service])

    # --- waiting --------------------------------------------------------------------------------

    def _next(self) -> tuple[Service, BatchReady | None]:
        """The batch the loop needs next (``None``: a broadcast epoch ended), within the timeout."""
        deadline = time.monotonic() + self._settings.timeout
        while True:
            if self._fleet.on_event != self._on_event:
                # Its runs are over: reading on would take the newer pass's batches.
                raise ServiceError("a newer iter() over this loader began; this pass is over")
            # Every step returns what the loop let go and names new batches, whether or not the
            # next one is already here: the services keep decoding ahead while the loop trains.
            now = time.monotonic()
            self._send_pending(now)
            # Take in what has arrived first, without waiting: a fatal error (an eviction, a
            # refusal) queued behind batches already read must stop the loop before they are handed
            # out (``Connection.read``).
            self._fleet.wait(now)
            self._collect(now)
            if not self._settings.broadcast:
                self._assign(now)
            got = self._take()
            if got is not None:
                return got
            if now >= deadline:
                raise self._timeout_error()
            if not self._settings.broadcast:
                self._check_not_starved()
            self._fleet.wait(deadline)
            self._collect(time.monotonic())

    def _take(self) -> tuple[Service, BatchReady | None] | None:
        if self._settings.broadcast:
            return self._broadcast_take()
        got = self._fleet_pass.take()
        return None if got is None else (got[0], got[1][1])

    def _collect(self, now: float) -> None:
        """Move what arrived from each session into the fleet pass (shard mode)."""
        if self._settings.broadcast:
            return
        for service in self._fleet.live:
            while (msg := service.conn.next_message()) is not None:
                if not isinstance(msg, BatchReady):
                    continue  # an ``end`` of a run before this one
                arrived = (service.conn.generation, msg)
                mine = msg.run == service.run and id(service) in self._started
                if not mine or not self._fleet_pass.arrived(service, msg.seq, arrived, now):
                    service.unread(msg, service.conn.generation)

    def _broadcast_take(self) -> tuple[Service, BatchReady | None] | None:
        """A broadcast member takes what its group's service planned, in order, from where the group
        is (NOTE [ Broadcast epochs ] in loader_service/supervisor/streams/stream.py)."""
        for service in self._fleet.live:
            while (msg := service.conn.next_message()) is not None:
                if isinstance(msg, EpochEnd) and msg.run == service.run:
                    return service, None
                if isinstance(msg, BatchReady) and msg.run == service.run:
                    return service, msg
                if isinstance(msg, BatchReady):
                    service.unread(msg, service.conn.generation)
        return None

    def _assign(self, now: float, starting: list[Service] | None = None) -> dict[Service, list[int]]:
        """Hand out batches to services with a free credit and name them (``want``); or, for
        ``starting`` services, only hand them out: their start names them."""
        fleet_pass = self._fleet_pass
        services = (
            starting if starting is not None else [s for s in self._fleet.live if id(s) in self._started]
        )
        free = {s: s.credits - s.in_use(self._waiting_leases(s)) - len(fleet_pass.owed(s)) for s in services}
        if starting is None:
            room = fleet_pass.make_room(free)
            if room is not None:
                service, (generation, msg) = room
                service.unread(msg, generation)
        out = fleet_pass.assign(free, now)
        if starting is None:
            for service, seqs in out.items():
                service.want(seqs)
        return out

    def _send_pending(self, now: float) -> None:
        for service in self._fleet.live:
            service.send_pending(self._fleet_pass.owed(service), self._waiting_leases(service), now)

    def _check_not_starved(self) -> None:
        """Fail at once, not after the timeout, when batches the loop holds use up every credit of
        every service (CPU zero-copy: only dropping them gives the credits back)."""
        live = self._fleet.live
        if not live or any(s.delivery.stager is not None or s.leases.held() < s.credits for s in live):
            return
        gc.collect()  # batches in unreachable cycles still pin their slots until collected
        if all(s.leases.held() >= s.credits for s in live):
            credits = sum(s.credits for s in live)
            raise ServiceError(
                f"this trainer still references all {credits} batches its credits allow, so no "
                "service can send another: drop references to old batches (keep .clone() copies if "
                "needed), or pass a larger credits= to ServiceLoader"
            )

    def _timeout_error(self) -> ServiceTimeout:
        now = time.monotonic()
        states = []
        for service in self._fleet.services:
            silent = now - service.conn.last_heard
            if service.refused:
                states.append(f"{service.endpoint} left out ({service.refused})")
            elif silent > self._settings.timeout / 2:
                states.append(f"{service.endpoint} silent for {silent:.0f} s")
            else:
                states.append(
                    f"{service.endpoint} alive but sent nothing; this trainer holds "
                    f"{service.leases.held()} of its {service.credits} credits"
                )
        return ServiceTimeout(f"no batch within {self._settings.timeout:.0f} s: {'; '.join(states)}")
