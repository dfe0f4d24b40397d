"""The services a loader is fed by: one ``Service`` each (session, pool, leases), polled together.

``Fleet`` owns them with one ``zmq.Poller`` and one heartbeat thread (``gpu_worker.heartbeats``).
It attaches to every endpoint at once, checks that they all serve the same feed (NOTE [ A fleet ] in
``gpu_worker/fleet_pass.py``), and on every wait reads what arrived, reconnects lost sessions without
blocking (NOTE [ Reconnecting ] in ``gpu_worker/client.py``), follows the addresses of endpoints
that name hosts (NOTE [ A fleet from a name ] in ``gpu_worker/names.py``) and reports what happened
to each session to the pass under way, which decides what it means for its batches.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch
import zmq

from gpu_worker.connection import BYE_LINGER_MS, Connection, ServiceError, ServiceTimeout, SessionEvent
from gpu_worker.delivery import Delivery
from gpu_worker.epoch_report import EpochReport
from gpu_worker.fleet_pass import Pace
from gpu_worker.heartbeats import Heartbeats
from gpu_worker.leases import LeaseBook
from gpu_worker.loader_config import MAX_ADDRESSES, MAX_ENDPOINTS, LoaderConfig
from gpu_worker.loop_clock import LoopClock
from gpu_worker.names import Name, Resolver, name_of
from gpu_worker.row_decoder import RowDecoder
from gpu_worker.service import Service
from protocol.curve import ClientKeys
from protocol.messages import FeedInfo, Hello, Welcome
from protocol.printable import printable

log = logging.getLogger(__name__)
POLL_SLICE = 0.1
"""Longest one wait on the poller: what could not be sent is offered again at least this often
(NOTE [ Releases that could not be sent ]), and finished device copies are collected."""
TURN = 3.0
"""Seconds an address of a name that has not answered holds a place in the fleet while other
addresses wait for one (NOTE [ A fleet from a name ] in gpu_worker/names.py): a service that can
answer does so in milliseconds, and one cut short is tried again at its next turn."""
SETTLE = 0.5
"""Seconds the attach still waits for a name's other addresses once one service has answered
(NOTE [ A fleet from a name ]); those that answer later join the pass under way."""
SAME_FEED = ("fingerprint", "seed", "batch_size", "image_size", "augment", "fields", "samples")
"""FeedInfo fields every service of a fleet must have alike (the same data, order, transform and
batch layout), and ``decoding`` word by word."""


class PassListener(Protocol):
    """The pass under way, as the fleet sees it: told what happens to each session, and asked
    which of a service's leases wait for the loop (a resumed session names them as held)."""

    def on_event(self, service: Service, event: SessionEvent, detail: Any) -> None: ...

    def waiting_leases(self, service: Service) -> tuple[int, ...]: ...


def _another_feed(differences: list[str]) -> str:
    return (
        f"serves another feed than the rest of the fleet: {'; '.join(differences)} "
        "(every service of a fleet needs the same data, seed, batch size, transform, fields, resize "
        "filter, decoder scaling and file limits)"
    )


def feed_differences(reference: FeedInfo, other: FeedInfo) -> list[str]:
    """Every way ``other`` serves something else than ``reference`` (NOTE [ A fleet ])."""
    found = [
        f"{name} {getattr(other, name)!r}, not {getattr(reference, name)!r}"
        for name in SAME_FEED
        if getattr(other, name) != getattr(reference, name)
    ]
    theirs, ours = _words(other.decoding), _words(reference.decoding)
    for key in sorted(ours.keys() | theirs.keys()):
        if theirs.get(key) != ours.get(key):
            found.append(f"{key} {theirs.get(key, '(not said)')!r}, not {ours.get(key, '(not said)')!r}")
    return found


def _words(decoding: str) -> dict[str, str]:
    """``FeedInfo.decoding`` as a dict of its ``KEY=VALUE`` words."""
    return dict(word.partition("=")[::2] for word in decoding.split())


class Fleet:
    """Every service of one loader, their poller and their heartbeat thread."""

    def __init__(
        self,
        config: LoaderConfig,
        hello: Hello,
        keys: ClientKeys | None,
        device: torch.device,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """``watch`` is called at every wait and raises to end the loop (a private service that
        exited: NOTE [ A private service ] in gpu_worker/local.py)."""
        self._watch = watch
        self.clock = LoopClock()
        self.by_source: Counter[int] = Counter()
        """Rows handed to the loop by source, over every pass (``loader.stats()``)."""
        self.last_epoch: EpochReport | None = None
        """The last pass that ran to its epoch's end, as ``gpu_worker.epoch_report`` reads it."""
        """The loop's waited and computed time (NOTE [ Exposed wait ]), sent with every heartbeat."""
        self.decoder = RowDecoder(config.decode, config.decode_threads, self.clock)
        """Decodes the encoded rows of every service's batches (NOTE [ Encoded rows ])."""
        self._heartbeats = Heartbeats(self.clock, lambda: self.decoder.share)
        self._config, self._hello, self._keys, self._device = config, hello, keys, device
        endpoints = config.endpoints
        names = tuple(name for name in map(name_of, endpoints) if name is not None)
        self._resolver = Resolver(names, config.resolve_interval, MAX_ADDRESSES)
        """Follows the endpoints that name hosts (NOTE [ A fleet from a name ])."""
        self._turns: dict[str, dict[str, float]] = {name.endpoint: {} for name in names}
        """For each name, when each of its addresses last began a turn in the fleet."""
        self._crowded: set[str] = set()
        """Names whose addresses wait for a place (said once, not at every wait)."""
        named = {name.endpoint for name in names}
        self.services = [self._service(endpoint) for endpoint in endpoints if endpoint not in named]
        self._retiring: list[Service] = []
        """Services whose address is gone from their name's answer, closed once the loop holds
        none of their batches."""
        self.paces: dict[Service, Pace] = {}
        """Each service's measured seconds per batch, kept from pass to pass (NOTE [ A fleet ])."""
        self.reference: FeedInfo | None = None
        """The feed every service must serve: the first one's to answer."""
        self.listener: PassListener | None = None
        """The pass under way; a newer one takes its place, and the older one then stops."""
        self._attaching = False
        self._poll = zmq.Poller()
        self._polled: tuple[zmq.Socket[bytes], ...] = ()

    def _service(self, endpoint: str, via: str = "") -> Service:
        leases = LeaseBook()
        conn = Connection(endpoint, self._hello, self._keys, self._heartbeats)
        delivery = Delivery(self._device, self._config.transport, leases, self.decoder, self._config.timeout)
        return Service(endpoint, conn, leases, delivery, self._config.credits, via=via)

    def attach(self, timeout: float) -> None:
        """Open a session with every service; wait up to ``timeout`` for all of them, or at least one.
        A name's addresses are waited for only ``SETTLE`` seconds once one service has answered
        (NOTE [ A fleet from a name ]).

        Raises ServiceError naming every difference if an endpoint given serves another feed than
        the first one to answer, and ServiceTimeout naming every endpoint if none answers.
        """
        for service in self.services:
            service.conn.connect()
        deadline = time.monotonic() + timeout
        settled = math.inf  # a name's addresses are waited for until ``SETTLE`` after an answer
        self._attaching = True
        try:
            while (now := time.monotonic()) < deadline and not self._all_answered(now >= settled):
                self.wait(deadline)
                if self.live:
                    settled = min(settled, time.monotonic() + SETTLE)
        finally:
            self._attaching = False
        self._check_same_feed()
        refused = [s for s in self.services if s.refused and not s.via]  # a name's: left out, logged
        if refused:
            raise ServiceError("; ".join(f"{s.endpoint} {s.refused}" for s in refused))
        missing = self._unanswered()
        if not self.live:
            raise ServiceTimeout(
                f"no loader service answered at {', '.join(missing)} within {timeout:.0f} s "
                "(is `loader-service serve` running there?)"
            )
        if missing:
            log.warning("no answer yet from %s; going on with the others", ", ".join(missing))

    def _all_answered(self, settled: bool) -> bool:
        """Every name resolved once (or failed to), and every service so far answered or refused;
        once ``settled``, a name's addresses need not have."""
        if self._resolver.names and not self._resolver.rounds:
            return False
        self._follow_names()  # what the first round found is in the fleet before it is judged
        awaited = [s for s in self.services if not (settled and s.via)]
        return bool(self.services) and all(s.open or s.refused for s in awaited)

    def _unanswered(self) -> list[str]:
        """Every endpoint given that has not answered, how many addresses of each name have not,
        and every name that cannot be resolved."""
        missing = [s.endpoint for s in self.services if not (s.via or s.open or s.refused)]
        for name, addresses in self._resolver.answers().items():
            silent = len(addresses) - sum(s.open for s in self.services if s.via == name.endpoint)
            if silent > 0:
                missing.append(f"{silent} of the {len(addresses)} addresses of {name.host}")
        failures = self._resolver.failures().items()
        return missing + [f"{name.host} (cannot be resolved: {why})" for name, why in failures]

    @property
    def live(self) -> list[Service]:
        return [s for s in self.services if s.open]

    def wait(self, deadline: float) -> None:
        """Wait until something arrives or ``deadline`` (at most POLL_SLICE), and take it in."""
        if self._watch is not None:
            self._watch()
        self._follow_names()
        remaining = max(0.0, min(deadline - time.monotonic(), POLL_SLICE))
        readable = dict(self._poller().poll(int(remaining * 1000) + 1 if remaining > 0 else 0))
        now = time.monotonic()
        for service in self.services:
            if service.refused:
                continue
            try:
                if service.conn.sock is not None and service.conn.sock in readable:
                    service.conn.read()
            except ServiceError as exc:
                if len(self.services) == 1:
                    raise
                self._leave_out(service, str(exc))  # one service refusing ends not the fleet
                continue
            service.conn.tick(now)
            self._handle_events(service)
        if self.services and all(s.refused for s in self.services):
            raise ServiceError("; ".join(f"{s.endpoint} {s.refused}" for s in self.services))

    # --- names (NOTE [ A fleet from a name ] in gpu_worker/names.py) ----------------------------

    def _follow_names(self) -> None:
        """Take in what the resolver last found: gone addresses leave, and the places free go to
        the others in turns until they answer. An address that comes back while its old service
        is still retiring joins once that one has closed."""
        self._close_retired()
        now = time.monotonic()
        for name, addresses in self._resolver.answers().items():
            wanted = [name.address(ip) for ip in addresses]  # lowest first
            self._leave_gone(name, set(wanted))
            self._take_turns(name, wanted, now)

    def _leave_gone(self, name: Name, wanted: set[str]) -> None:
        """Services of addresses gone from the answer leave: one that never answered, or was left
        out, at once; one in use once the loop holds none of its batches (``_retire``)."""
        turns = self._turns[name.endpoint]
        for endpoint in [endpoint for endpoint in turns if endpoint not in wanted]:
            del turns[endpoint]
        for service in [s for s in self.services if s.via == name.endpoint and s.endpoint not in wanted]:
            if service in self._retiring:
                continue
            if service.info is None or service.refused:
                self._drop(service)  # nothing of it is the loop's; a comeback is tried afresh
            else:
                self._retire(service, f"is no longer an address of {name.host}")

    def _take_turns(self, name: Name, wanted: list[str], now: float) -> None:
        """Give the places free to addresses waiting for one, never tried ones first, then the one
        whose last turn is oldest; a silent one whose turn is over makes room for one waiting."""
        turns = self._turns[name.endpoint]
        known = {s.endpoint for s in self.services}
        waiting = sorted((e for e in wanted if e not in known), key=lambda e: turns.get(e, -math.inf))
        if not waiting:
            self._crowded.discard(name.endpoint)
            return
        free = MAX_ENDPOINTS - sum(not s.refused for s in self.services)
        mine = [s for s in self.services if s.via == name.endpoint and s.info is None and not s.refused]
        over = sorted((s for s in mine if now - turns[s.endpoint] >= TURN), key=lambda s: turns[s.endpoint])
        for service in over[: max(0, len(waiting) - free)]:
            log.debug("%s has not answered in %.0f s: its place goes to another", service.endpoint, TURN)
            self._drop(service)
            free += 1
        if free < len(waiting) and name.endpoint not in self._crowded:
            self._crowded.add(name.endpoint)
            log.info(
                "%s resolves to %d addresses and a fleet has %d places: those not answering take turns",
                name.host,
                len(wanted),
                MAX_ENDPOINTS,
            )
        for endpoint in waiting[: max(0, free)]:
            self._join(endpoint, name, now)

    def _join(self, endpoint: str, name: Name, now: float) -> None:
        turns = self._turns[name.endpoint]
        level = logging.DEBUG if endpoint in turns else logging.INFO  # a turn again, or new
        log.log(level, "%s resolves to %s: joining it", name.host, endpoint)
        turns[endpoint] = now
        service = self._service(endpoint, via=name.endpoint)
        self.services.append(service)
        service.conn.connect()

    def _drop(self, service: Service) -> None:
        """Forget a service none of whose batches is the loop's (it never answered, or was left
        out and closed then); its socket ends off the loop's thread."""
        self.services.remove(service)
        self.paces.pop(service, None)
        if not service.refused:
            service.close()

    def _retire(self, service: Service, why: str) -> None:
        """Stop using ``service``: the pass gives its batches to the others; its session ends once
        the loop holds none of its batches (their slots stay the loop's until then)."""
        log.info("leaving %s: it %s", service.endpoint, printable(why))
        service.refused = why
        if self.listener is not None:
            self.listener.on_event(service, SessionEvent.REFUSED, why)
        self._retiring.append(service)
        self._close_retired()

    def _close_retired(self) -> None:
        for service in [s for s in self._retiring if not s.leases.held()]:
            self._retiring.remove(service)
            self.services.remove(service)
            self.paces.pop(service, None)
            service.close()

    def _poller(self) -> zmq.Poller:
        """One poller over every session's socket, made again only when a socket changed."""
        socks = tuple(s.conn.sock for s in self.services if s.conn.sock is not None and not s.refused)
        if socks != self._polled:
            self._polled, self._poll = socks, zmq.Poller()
            for sock in socks:
                self._poll.register(sock, zmq.POLLIN)
        return self._poll

    def _handle_events(self, service: Service) -> None:
        conn = service.conn
        while conn.events:
            what, detail = conn.events.popleft()
            if what is SessionEvent.OPENED and not self._same_feed(service, detail):
                return
            if what is SessionEvent.OPENED:
                service.adopt(detail)
            elif what is SessionEvent.RESUMED:
                service.leases.resumed(conn.incarnation, service.resume_held)
                log.warning("resumed session %s with %s", printable(conn.session), service.endpoint)
            elif what is SessionEvent.LOST:
                log.warning("lost the loader service at %s (%s); reconnecting", service.endpoint, detail)
                waiting = () if self.listener is None else self.listener.waiting_leases(service)
                service.resume_held = service.held(waiting)
                conn.connect(service.resume_held)
            if self.listener is not None:
                self.listener.on_event(service, what, detail)

    def _check_same_feed(self) -> None:
        """NOTE [ A fleet ]: after attaching, the first endpoint (in the order given) that answered
        sets the feed, whichever answered first; every other one serving another feed is left out."""
        answered = [s for s in self.services if s.info is not None and not s.refused]
        if not answered:
            return
        reference = self.reference = answered[0].info
        assert reference is not None
        for service in answered[1:]:
            assert service.info is not None
            differences = feed_differences(reference, service.info)
            if differences:
                self._leave_out(service, _another_feed(differences))

    def _same_feed(self, service: Service, welcome: Welcome) -> bool:
        """NOTE [ A fleet ]: a service that answers after the attach must serve the fleet's feed."""
        if self._attaching:
            return True  # compared all together once everyone answered (``_check_same_feed``)
        assert self.reference is not None  # set by ``attach``, which fails if no service answered
        differences = feed_differences(self.reference, welcome.feed)
        if not differences:
            return True
        self._leave_out(service, _another_feed(differences))
        return False

    def _leave_out(self, service: Service, why: str) -> None:
        """Stop using ``service`` for good; the pass under way gives its batches to the others."""
        service.refused = why
        log.error("leaving %s out: it %s", service.endpoint, printable(why))
        if self.listener is not None:
            self.listener.on_event(service, SessionEvent.REFUSED, why)
        service.close()

    def endpoint_stats(self) -> dict[str, dict[str, object]]:
        """``loader.stats()["endpoints"]``: per service, its batches and images handed to the loop,
        images/s while it did, and whether it is in use."""
        return {
            s.endpoint: {
                "batches": s.share.batches,
                "images": s.share.images,
                "images_per_s": round(s.share.rate(), 1),
                "state": "left out" if s.refused else "attached" if s.open else "reconnecting",
            }
            for s in self.services
        }

    def close(self) -> None:
        """Leave every service. The byes get ``BYE_LINGER_MS`` to go out all together, not one
        after another; a service that never answered is sent none and not waited for."""
        self._resolver.close()
        endings = [s.close() for s in self.services if not s.refused or s in self._retiring]
        deadline = time.monotonic() + BYE_LINGER_MS / 1000
        for ending in endings:
            ending.join(max(0.0, deadline - time.monotonic()))
        self._heartbeats.close()
        self.decoder.close()
