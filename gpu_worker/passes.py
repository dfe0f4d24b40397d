"""One pass of the loop over an epoch (or what is left of it): the pass owns its state, the loader
owns the configuration and the sessions (``gpu_worker.fleet``).

A ``ShardPass`` hands its batches out across the fleet and puts them back in plan order (NOTE [ A
fleet ] in ``gpu_worker/fleet_pass.py``); a ``BroadcastPass`` takes what its one service plans for
the group. The kind is chosen once, from the loader's mode (``make_pass``). Either way the loop
gets each batch of the pass once, in order. The fleet tells the pass under way (its ``listener``)
what happens to each session; a newer pass takes that place, and an older one then stops.

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
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpu_worker.batch import Batch
from gpu_worker.connection import ServiceError, ServiceTimeout, SessionEvent
from gpu_worker.epoch_report import EpochReport
from gpu_worker.fleet import Fleet
from gpu_worker.fleet_pass import FleetPass
from gpu_worker.service import Service
from gpu_worker.weighting import Change
from protocol.messages import BatchReady, EpochEnd, Start

log = logging.getLogger(__name__)
Arrived = tuple[int, BatchReady]
"""(session incarnation, announcement): what waits in the fleet pass."""


@dataclass
class PassSettings:
    epoch: int
    position: int
    batches: int
    timeout: float
    empty_batches: bool = False
    """Hand the loop batches whose every sample was bad, with no rows (NOTE [ Empty batches ])."""
    offset: int = 0
    """Shard mode: positions of the epoch's order an earlier job took; this pass shares out the
    rest (NOTE [ Elastic epochs ] in protocol/shares.py)."""
    changes: tuple[Change, ...] = ()
    """A weighted job's weight changes, sent with every start (NOTE [ Weight changes ])."""


class EpochPass:
    """Iterate once: ``for batch in pass_``. ``position`` counts the batches handed out. What the two
    kinds share: the loop, the wait and its timeout, and the fleet's events."""

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
        self._replan = False
        """Weights changed: start the runs again from the loop's next batch (``replan``)."""
        self._earlier: Counter[str] = Counter()
        """``counts`` of the fleet passes a replan replaced."""

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
        return self._earlier + Counter(reassigned=d.reassigned, backups=d.backups, empty=self.empty)

    def replan(self, changes: tuple[Change, ...]) -> None:
        """New weight changes during the pass: the runs start again from the loop's next batch, at
        its next pull (NOTE [ Weight changes ] in gpu_worker/weighting.py)."""
        self._settings.changes = changes
        self._replan = True

    def __iter__(self) -> Iterator[Batch]:
        fleet = self._fleet
        clock = fleet.clock
        self.active = True
        fleet.listener = self
        began, (waited, computed), images, handed = time.monotonic(), clock.totals(), 0, 0
        try:
            for service in fleet.live:
                self._fleet_pass.joined(service)
            self._begin(fleet.live)
            while self.position < self._settings.batches:
                if self._replan:
                    self._restart()
                clock.waiting()  # NOTE [ Exposed wait ]: only the pull counts as waiting
                service, msg = self._next()
                if msg is None:  # the broadcast epoch's end
                    clock.computing()
                    break
                batch = service.wrap(msg)  # its encoded rows' decode, if not done yet, is waiting too
                clock.computing()
                fleet.decoder.handed(len(batch.indices))
                self.position = self._after(msg)
                if not len(batch.indices):
                    self.empty += 1
                if len(batch.indices) or self._settings.empty_batches:
                    service.share.add(len(batch.indices), time.monotonic())
                    fleet.by_source.update(batch.sources.tolist())
                    images, handed = images + len(batch.indices), handed + 1
                    self.last_endpoint = service.endpoint
                    yield batch
                del batch  # the generator must not keep the previous batch's slot while waiting
            self.position = max(self.position, self._settings.batches)
            self._send_pending(time.monotonic())  # credits back now, so the next pass starts at once
            now_waited, now_computed = clock.totals()
            spent = (time.monotonic() - began, now_waited - waited, now_computed - computed)
            fleet.last_epoch = EpochReport(self.epoch, handed, images, *spent)
            log.info("%s", fleet.last_epoch.line())
        finally:
            clock.idle()
            self._leave()

    def _restart(self) -> None:
        """New runs from the loop's next batch on every live service; what arrived for the old
        runs is given back unread, and a service that is away gets its start when it returns."""
        self._replan = False
        self._earlier = self.counts() - Counter(empty=self.empty)
        for service, (incarnation, msg) in self._fleet_pass.drain():
            service.unread(msg, incarnation)
        self._fleet_pass = FleetPass(self.position, self._settings.batches, _paces=self._fleet.paces)
        self._started.clear()
        for service in self._fleet.live:
            self._fleet_pass.joined(service)
        self._begin(self._fleet.live)

    def _leave(self) -> None:
        self.active = False
        if self._fleet.listener is self:
            self._fleet.listener = None
        for service, (incarnation, msg) in self._fleet_pass.drain():
            service.unread(msg, incarnation)

    def waiting_leases(self, service: Service) -> tuple[int, ...]:
        """Leases of batches taken from ``service`` that wait for the loop (``PassListener``)."""
        now = service.incarnation
        return tuple(msg.lease for came_in, msg in self._fleet_pass.waiting(service) if came_in == now)

    def on_event(self, service: Service, event: SessionEvent, detail: Any) -> None:
        """What happened to a session means for this pass's batches (NOTE [ A fleet ])."""
        fleet_pass = self._fleet_pass
        if event is SessionEvent.LOST:
            fleet_pass.lost(service)
        elif event is SessionEvent.RESUMED:
            fleet_pass.joined(service)
            if id(service) not in self._started:  # it was lost before this pass began
                self._begin([service])
        else:  # REFUSED or OPENED
            # Left out for good, or a new session: it owes nothing, and what came from it is gone.
            for incarnation, msg in fleet_pass.drop_waiting(service):
                service.unread(msg, incarnation)
            fleet_pass.forget(service)
            if event is SessionEvent.OPENED:
                fleet_pass.joined(service)
                self._begin([service])

    # --- what each kind does its own way ----------------------------------------------------------

    def _begin(self, services: list[Service]) -> None:
        """A new run on ``services``."""
        raise NotImplementedError

    def _after(self, msg: BatchReady) -> int:
        """The position once the loop has ``msg``'s batch."""
        raise NotImplementedError

    def _step(self, now: float) -> tuple[Service, BatchReady | None] | None:
        """Take in what arrived and hand out what is owed; the batch the loop gets next, if here."""
        raise NotImplementedError

    def _while_waiting(self) -> None:
        """Checked before each wait for more."""

    def _new_run(self, services: list[Service]) -> None:
        for service in services:
            service.run += 1
            self._started.add(id(service))

    # --- waiting --------------------------------------------------------------------------------

    def _next(self) -> tuple[Service, BatchReady | None]:
        """The batch the loop needs next (``None``: a broadcast epoch ended), within the timeout."""
        deadline = time.monotonic() + self._settings.timeout
        while True:
            if self._fleet.listener is not self:
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
            got = self._step(now)
            if got is not None:
                return got
            if now >= deadline:
                raise self._timeout_error()
            self._while_waiting()
            self._fleet.wait(deadline)

    def _send_pending(self, now: float) -> None:
        for service in self._fleet.live:
            service.send_pending(self._fleet_pass.owed(service), self.waiting_leases(service), now)

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
            silent = service.silent_for(now)
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


class ShardPass(EpochPass):
    """A rank's share of an epoch, handed out across the fleet and put back in plan order."""

    def _begin(self, services: list[Service]) -> None:
        """A picked run on each, with the batches assigned to it (one at a time to the one expected
        first: never a block each)."""
        self._new_run(services)
        now = time.monotonic()
        first = self._assign(now, services)
        for service in services:
            want = tuple(first.get(service, ()))
            transport = service.delivery.transport
            settings = self._settings
            start = Start(
                service.run,
                self.epoch,
                self.position,
                transport,
                True,
                want,
                offset=settings.offset,
                changes=settings.changes,
            )
            service.send_start(start)
            service.named_at = now

    def _after(self, msg: BatchReady) -> int:
        return self.position + 1

    def _step(self, now: float) -> tuple[Service, BatchReady | None] | None:
        self._collect(now)
        self._assign(now)
        got = self._fleet_pass.take()
        return None if got is None else (got[0], got[1][1])

    def _while_waiting(self) -> None:
        self._check_not_starved()

    def _collect(self, now: float) -> None:
        """Move what arrived from each session into the fleet pass."""
        for service in self._fleet.live:
            for incarnation, msg in service.messages():
                if not isinstance(msg, BatchReady):
                    continue  # an ``end`` of a run before this one
                mine = msg.run == service.run and id(service) in self._started
                if not mine or not self._fleet_pass.arrived(service, msg.seq, (incarnation, msg), now):
                    service.unread(msg, incarnation)
                else:
                    service.arrived(msg, incarnation)

    def _assign(self, now: float, starting: list[Service] | None = None) -> dict[Service, list[int]]:
        """Hand out batches to services with a free credit and name them (``want``); or, for
        ``starting`` services, only hand them out: their start names them."""
        fleet_pass = self._fleet_pass
        services = (
            starting if starting is not None else [s for s in self._fleet.live if id(s) in self._started]
        )
        free = {s: s.credits - s.in_use(self.waiting_leases(s)) - len(fleet_pass.owed(s)) for s in services}
        if starting is None:
            room = fleet_pass.make_room(free)
            if room is not None:
                service, (incarnation, msg) = room
                service.unread(msg, incarnation)
        out = fleet_pass.assign(free, now)
        if starting is None:
            for service, seqs in out.items():
                service.want(seqs)
        return out


class BroadcastPass(EpochPass):
    """A broadcast member's epoch: what its group's one service plans, in order, from where the
    group is (NOTE [ Broadcast epochs ] in loader_service/supervisor/streams/stream.py)."""

    def _begin(self, services: list[Service]) -> None:
        self._new_run(services)
        for service in services:
            service.send_start(Start(service.run, self.epoch, self.position, service.delivery.transport))

    def _after(self, msg: BatchReady) -> int:
        return msg.seq + 1

    def _step(self, now: float) -> tuple[Service, BatchReady | None] | None:
        for service in self._fleet.live:
            for incarnation, msg in service.messages():
                if isinstance(msg, EpochEnd) and msg.run == service.run:
                    return service, None
                if isinstance(msg, BatchReady) and msg.run == service.run:
                    return service, msg
                if isinstance(msg, BatchReady):
                    service.unread(msg, incarnation)
        return None


def make_pass(fleet: Fleet, settings: PassSettings, broadcast: bool) -> EpochPass:
    """The kind of pass the loader's mode calls for."""
    return (BroadcastPass if broadcast else ShardPass)(fleet, settings)
