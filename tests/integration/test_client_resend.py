"""A trainer keeps what its socket refused and sends it later, so a stall never costs it a credit.

A fake service on a real ROUTER delivers batches, then becomes unreachable: its socket closes and a
plain Unix socket takes the endpoint, accepting the trainer's reconnections but never answering.
Messages then pile up in the trainer's socket until, with a send high-water mark of 1, the socket
refuses them (EAGAIN). The service comes back on the same endpoint and counts what arrives.
(NOTE [ Releases that could not be sent ] in gpu_worker/leases.py.)
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import pytest
import zmq

from gpu_worker import Batch, ServiceLoader, connection
from protocol.codec import decode, encode
from protocol.layout import SlotLayout
from protocol.messages import (
    Ack,
    BatchReady,
    Bye,
    FeedInfo,
    Heartbeat,
    Hello,
    Message,
    Release,
    Start,
    Want,
    Welcome,
)
from tests.helpers import fake_segment, in_background

pytestmark = pytest.mark.integration
FROM_TRAINER = (Hello, Start, Want, Release, Ack, Heartbeat, Bye)
WAIT = 10.0
"""Seconds any one step of a test may take; a step that needs longer is a failure."""
HEARTBEAT = 0.2
"""Seconds between the fake service's heartbeats while it waits."""
LEASES = tuple(range(1, 9))
"""A session's leases are numbered from 1 (NOTE [ Acknowledged delivery ])."""
M = TypeVar("M", bound=Message)


class Unreachable(logging.Handler):
    """Sets ``refused`` when the trainer's socket refuses a message (its debug line says so)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.refused = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("could not send"):
            self.refused.set()


class FlakyService:
    """A fake service that can go unreachable and come back at the same ipc endpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.endpoint = f"ipc://{path}"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._listener: socket.socket | None = None
        self._accepted: list[socket.socket] = []
        self._trainer: bytes | None = None  # the routing id of the trainer's latest hello
        self._unread: list[tuple[bytes, Message]] = []
        self.released: list[int] = []
        """Every lease released to this service, in order of arrival (repeats included)."""
        self.come_back()

    def recv(self, kind: type[M]) -> tuple[bytes, M]:
        """The next ``kind`` message and its sender (read now, or kept by ``await_releases``)."""
        for rid, msg in self._unread:
            if isinstance(msg, kind):
                self._unread.remove((rid, msg))
                return rid, msg
        deadline = time.monotonic() + WAIT
        while (got := self._next(deadline)) is not None:
            if isinstance(got[1], kind):
                return got[0], got[1]
        raise AssertionError(f"no {kind.KIND} from the trainer within {WAIT:.0f} s")

    def await_releases(self, leases: set[int]) -> None:
        """Read until all of ``leases`` have been released, for ``WAIT`` seconds at most."""
        deadline = time.monotonic() + WAIT
        while not leases <= set(self.released) and (got := self._next(deadline)) is not None:
            if not isinstance(got[1], Release):
                self._unread.append(got)

    def _next(self, deadline: float) -> tuple[bytes, Message] | None:
        """The next message before ``deadline``, heartbeating the trainer while none comes (a real
        service does, and without it a trainer would take a long wait here for a lost service)."""
        assert self._router is not None
        while not self._router.poll(int(min(HEARTBEAT, max(0.0, deadline - time.monotonic())) * 1000)):
            if time.monotonic() >= deadline:
                return None
            if self._trainer is not None:
                self.send(self._trainer, Heartbeat())
        rid, frame = self._router.recv_multipart()
        msg = decode(frame, FROM_TRAINER)
        if isinstance(msg, Hello):
            self._trainer = rid
        if isinstance(msg, Release):
            self.released.extend(msg.leases)
        return rid, msg

    def send(self, rid: bytes, *msgs: Message) -> None:
        assert self._router is not None
        for msg in msgs:
            self._router.send_multipart([rid, encode(msg)])

    def vanish(self) -> None:
        """Stop answering: the ROUTER goes (after flushing what it sent), a silent listener comes."""
        assert self._router is not None
        self._router.close(linger=int(WAIT * 1000))
        self._router = None
        self.path.unlink()  # libzmq leaves the file; new connections must reach the listener below
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(8)
        self._listener.settimeout(WAIT)

    def await_connections(self, count: int) -> None:
        """Wait until ``count`` sockets in all have reconnected to the silent listener."""
        assert self._listener is not None
        while len(self._accepted) < count:
            self._accepted.append(self._listener.accept()[0])

    def come_back(self) -> None:
        for sock in [*self._accepted, *([self._listener] if self._listener else [])]:
            sock.close()
        self._accepted, self._listener = [], None
        self.path.unlink(missing_ok=True)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.endpoint)

    def close(self) -> None:
        for sock in [*self._accepted, *([self._listener] if self._listener else [])]:
            sock.close()
        self._ctx.destroy(linger=0)  # also a ROUTER still lingering after ``vanish``


@pytest.fixture
def segment() -> Iterator[str]:
    """A real segment of ours holding one slot of 4 images of 8 px."""
    with fake_segment(fill=0) as name:
        yield name


@pytest.fixture
def service(tmp_path: Path) -> Iterator[FlakyService]:
    flaky = FlakyService(tmp_path / "flaky.sock")
    yield flaky
    flaky.close()


@pytest.fixture
def unreachable(monkeypatch: pytest.MonkeyPatch) -> Iterator[Unreachable]:
    """A send high-water mark of 1, so that the second message to an unreachable service is refused."""
    monkeypatch.setattr(connection, "SEND_HWM", 1)
    handler = Unreachable()
    logger = logging.getLogger("gpu_worker.connection")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def welcome(segment: str, heartbeat_interval: float) -> Welcome:
    feed = FeedInfo(
        "train", 32, 2, 4, 8, len(LEASES), 0, "train", "ff" * 16, segment, 1, SlotLayout.images(4, 8).wire()
    )
    return Welcome("s", feed, heartbeat_interval, len(LEASES), 4 * len(LEASES), token="secret-token")


def batches(start: Start, count: int) -> list[Message]:
    """What a service sends for a picked start asking for batches ``0 .. count-1``."""
    assert start.picked and start.want == tuple(range(count)), start
    return [BatchReady(start.run, start.epoch, seq, LEASES[seq], 0, 4) for seq in range(count)]


def serve_epoch(service: FlakyService, rid: bytes, start: Start, first_lease: int) -> None:
    """Answer a picked start and the wants after it until every batch of the epoch went out."""
    sent: set[int] = set()
    asked = list(start.want)
    while True:
        for seq in [seq for seq in asked if seq not in sent]:
            service.send(rid, BatchReady(start.run, start.epoch, seq, first_lease + len(sent), 0, 4))
            sent.add(seq)
        if len(sent) == len(LEASES):
            return
        asked = list(service.recv(Want)[1].seqs)


def reached(event: threading.Event, fake: Future[None]) -> None:
    """Wait for the fake service to set ``event``; if it failed on the way, raise its error."""
    if not event.wait(WAIT):
        error = fake.exception(WAIT)  # each of its steps is bounded too
        raise AssertionError(f"the fake service did not get there within {WAIT:.0f} s") from error


def running(script: Callable[[], None]) -> AbstractContextManager[Future[None]]:
    """``script`` (the fake service's side) on a thread (``tests.helpers.in_background``)."""
    return in_background(script, "the fake service", timeout=3 * WAIT)


def test_releases_refused_mid_epoch_are_sent_when_the_service_is_back(
    service: FlakyService, segment: str, unreachable: Unreachable
) -> None:
    """The loop lets batches go while the service is unreachable; every lease still comes back."""
    holding, gone = threading.Event(), threading.Event()

    def fake() -> None:
        rid, _ = service.recv(Hello)
        service.send(rid, welcome(segment, heartbeat_interval=5.0))
        rid, start = service.recv(Start)
        *first, last = batches(start, len(LEASES))
        service.send(rid, *first)
        assert holding.wait(WAIT)
        service.vanish()
        service.await_connections(2)  # the trainer's socket and its heartbeat socket
        unreachable.refused.clear()
        gone.set()
        assert unreachable.refused.wait(WAIT), "no send was refused: the test tested nothing"
        service.come_back()
        service.await_releases(set(LEASES[:3]))
        service.send(rid, last)  # the trainer waits for it, offering its kept releases meanwhile

    with (
        running(fake) as outcome,
        ServiceLoader(service.endpoint, connect_timeout=WAIT, timeout=3 * WAIT, credits=16) as loader,
    ):
        it = iter(loader)
        held: list[Batch] = [next(it) for _ in range(4)]
        holding.set()
        reached(gone, outcome)
        for batch in it:  # three more are here already: each step lets the oldest batch go
            held.pop(0)
            held.append(batch)
        outcome.result(3 * WAIT)
    assert sorted(service.released) == list(LEASES[:3]), "every lease let go is released, once"


def test_a_refused_start_is_sent_when_the_service_is_back(
    service: FlakyService, segment: str, unreachable: Unreachable
) -> None:
    """The next epoch is asked for while the service is unreachable; it still begins."""
    holding, gone = threading.Event(), threading.Event()

    starts: list[Start] = []

    def fake() -> None:
        rid, _ = service.recv(Hello)
        service.send(rid, welcome(segment, heartbeat_interval=5.0))
        rid, start = service.recv(Start)
        service.send(rid, *batches(start, len(LEASES)))
        assert holding.wait(WAIT)
        service.vanish()
        service.await_connections(2)
        unreachable.refused.clear()
        gone.set()
        assert unreachable.refused.wait(WAIT), "no send was refused: the test tested nothing"
        service.come_back()
        service.await_releases(set(LEASES))
        rid, second = service.recv(Start)
        starts.append(second)
        serve_epoch(service, rid, second, first_lease=LEASES[-1] + 1)

    with (
        running(fake) as outcome,
        ServiceLoader(service.endpoint, connect_timeout=WAIT, timeout=3 * WAIT, credits=16) as loader,
    ):
        held = list(loader)
        holding.set()
        reached(gone, outcome)
        del held
        assert len(list(loader)) == len(LEASES)
        outcome.result(3 * WAIT)
    assert [(s.epoch, s.position) for s in starts] == [(1, 0)]
    first_epoch = [lease for lease in service.released if lease in LEASES]
    assert sorted(first_epoch) == list(LEASES), "every lease let go is released, once"


def test_a_resumed_session_gets_no_release_it_already_returned(
    service: FlakyService, segment: str, unreachable: Unreachable
) -> None:
    """Releases refused before a resume are dropped (the service returned those leases itself);
    batches held across the resume are still released when the loop lets them go; the run goes on
    (no new start) and the hello says how far every announcement arrived."""
    holding, gone = threading.Event(), threading.Event()

    hellos: list[Hello] = []

    def fake() -> None:
        rid, _ = service.recv(Hello)
        service.send(rid, welcome(segment, heartbeat_interval=0.5))  # silent for 3 s: lost
        rid, start = service.recv(Start)
        *first, last = batches(start, len(LEASES))
        service.send(rid, *first)
        assert holding.wait(WAIT)
        service.vanish()
        service.await_connections(2)
        unreachable.refused.clear()
        gone.set()
        service.await_connections(3)  # the trainer gave the old connection up and opened a new one
        assert unreachable.refused.is_set(), "no send was refused: the test tested nothing"
        service.come_back()
        rid, hello = service.recv(Hello)
        hellos.append(hello)
        service.send(rid, welcome(segment, heartbeat_interval=0.5), last)  # the same run goes on
        rid, following = service.recv(Start)
        service.await_releases(set(LEASES[3:]))
        serve_epoch(service, rid, following, first_lease=LEASES[-1] + 1)

    with (
        running(fake) as outcome,
        ServiceLoader(service.endpoint, connect_timeout=WAIT, timeout=3 * WAIT, credits=16) as loader,
    ):
        it = iter(loader)
        held: list[Batch] = [next(it) for _ in range(4)]
        holding.set()
        reached(gone, outcome)
        for batch in it:
            held.pop(0)
            held.append(batch)
        del held, batch
        assert len(list(loader)) == len(LEASES)
        outcome.result(3 * WAIT)
    assert [(h.resume, sorted(h.held), h.have) for h in hellos] == [("secret-token", list(LEASES[3:7]), 7)]
    assert sorted(service.released) == list(LEASES[3:]), "held ones released once; returned ones never"
