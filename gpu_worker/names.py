"""An endpoint that names a host: a fleet of every address the name resolves to, followed as it changes.

NOTE [ A fleet from a name ]
    ``tcp://NAME:PORT`` (NAME not an IP address) is a fleet of every IPv4 address NAME resolves to
    (a Kubernetes headless Service's name gives one address per ready pod). ZeroMQ would resolve
    the name itself and connect to one address only; so the loader resolves it, and again every
    ``resolve_interval`` seconds while it lives, in a thread of its own (``Resolver``): a lookup
    can block for as long as the resolver's timeouts, and the loop never waits on one.
    * An address that appears joins the pass under way as a new service of the fleet (its session
      opens, its feed is checked like any other's, and it is given batches as soon as it has a
      free credit).
    * A fleet (``Fleet`` in gpu_worker/fleet.py) has ``MAX_ENDPOINTS`` places. A service that
      has answered keeps its place; an address that has not answered holds one for a turn of
      ``TURN`` seconds only while other addresses wait for a place, then makes room and waits for
      its next turn (never tried ones go first, lowest first, then the one whose last turn is
      oldest). So silent addresses, however many and wherever they sort, never hide the ones
      that answer. At most ``MAX_ADDRESSES`` of an answer (the lowest) are taken, since the
      answer is a peer's word.
    * The attach needs one address of a name to answer, not all: the others get ``SETTLE``
      seconds more, then keep trying while the loader runs and join when they answer. An address
      serving another feed than the fleet's is left out (logged) and never fails the attach:
      whether it answers before the attach returns is a matter of timing.
    * An address that is gone from the answer leaves: the batches it owed and those that arrived
      from it and wait for the loop go to the others (as for a lost service, NOTE [ A fleet ]);
      its session ends once the loop holds none of its batches, so a slot the loop still reads
      is never given back early. One left out (another feed, a refusal) leaves with its
      address too, and is tried afresh when the address comes back.
    * Leaving never blocks the loop: a service that never opened a session is dropped with no
      bye and no linger; one that did is sent a bye, and its socket's linger runs on a thread of
      its own (``Connection.close``). ``Fleet.close`` waits for every bye once, all together.
    * A lookup that fails (the name is unknown for a while, the resolver is down) changes
      nothing: the addresses known stay, and one whose service is really gone is lost through its
      heartbeats as always.
    * IPv4 only, as ZeroMQ's sockets connect by default.
    Every address is expected to serve the same feed with the same server key (one Kubernetes
    Secret for the services' key pair).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Name:
    """``tcp://HOST:PORT`` whose HOST is a name to resolve."""

    endpoint: str
    host: str
    port: int

    def address(self, ip: str) -> str:
        """The endpoint of one address of this name."""
        return f"tcp://{ip}:{self.port}"


def name_of(endpoint: str) -> Name | None:
    """The name an endpoint gives, or None for an ``ipc://`` path or an address given as such.

    Raises ValueError for ``tcp://`` without a port in 1..65535."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port_text = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"endpoint must be tcp://HOST:PORT with a port in 1..65535, got {endpoint!r}")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"endpoint names no host: {endpoint!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return Name(endpoint, host, int(port_text))
    return None


def lookup(host: str, port: int, limit: int) -> tuple[str, ...]:
    """Every IPv4 address of ``host``, lowest first, at most ``limit``. Raises OSError if the name
    cannot be resolved now."""
    answers = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    found = sorted({str(info[4][0]) for info in answers}, key=ipaddress.IPv4Address)
    if len(found) > limit:
        log.warning("%s resolves to %d addresses; using the lowest %d", host, len(found), limit)
    return tuple(found[:limit])


class Resolver:
    """Resolves names in a thread of its own, at once and then every ``interval`` seconds (never
    again if ``interval`` is 0); the loop reads the latest answers without waiting."""

    def __init__(self, names: tuple[Name, ...], interval: float, limit: int) -> None:
        self._names = names
        self._interval = interval
        self._limit = limit
        self._lock = threading.Lock()
        self._answers: dict[Name, tuple[str, ...]] = {}
        self._failures: dict[Name, str] = {}
        self._rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dataferry-resolver", daemon=True)
        if names:
            self._thread.start()

    @property
    def names(self) -> tuple[Name, ...]:
        return self._names

    def answers(self) -> dict[Name, tuple[str, ...]]:
        """The latest addresses of every name that has resolved at least once."""
        with self._lock:
            return dict(self._answers)

    @property
    def rounds(self) -> int:
        """Lookups of every name done so far (the first round is done once this is 1)."""
        with self._lock:
            return self._rounds

    def failures(self) -> dict[Name, str]:
        """Why each name that has never resolved failed its latest lookup."""
        with self._lock:
            return {name: why for name, why in self._failures.items() if name not in self._answers}

    def _run(self) -> None:
        while True:
            for name in self._names:
                self._resolve(name)
            with self._lock:
                self._rounds += 1
            if not self._interval or self._stop.wait(self._interval):
                return

    def _resolve(self, name: Name) -> None:
        try:
            found = lookup(name.host, name.port, self._limit)
        except OSError as exc:  # socket.gaierror included: keep what was known (NOTE above)
            with self._lock:
                known = name in self._answers
                self._failures[name] = str(exc)
            log.log(logging.WARNING if known else logging.INFO, "cannot resolve %s now: %s", name.host, exc)
            return
        with self._lock:
            self._answers[name] = found
            self._failures.pop(name, None)

    def close(self) -> None:
        self._stop.set()
