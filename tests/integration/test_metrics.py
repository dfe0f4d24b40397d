"""The service's Prometheus endpoint, scraped over HTTP while a trainer runs."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gpu_worker import ServiceLoader
from protocol.codec import decode, encode
from protocol.messages import BatchReady, EpochEnd, ErrorReply, Heartbeat, Hello, Start, Welcome
from tests.helpers import ServiceFactory, free_port

pytestmark = pytest.mark.integration


def sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name)]
    assert lines, f"{name} not exposed:\n{text}"
    return float(lines[0].rsplit(" ", 1)[1])


def test_every_leased_batch_records_how_long_it_waited_ready(
    photos: Path, start_service: ServiceFactory
) -> None:
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, batch_size=8, metrics_port=port)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        batches = sum(1 for _ in loader)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert sample(text, 'dataferry_batch_ready_wait_seconds_count{feed="train"}') == batches
    assert sample(text, 'dataferry_batch_ready_wait_seconds_sum{feed="train"}') >= 0


def train_for(loader: ServiceLoader, seconds: float, step: float) -> None:
    """Epochs of a loop whose step takes ``step`` seconds, until ``seconds`` have passed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in loader:
            time.sleep(step)  # the training step: the loop computes, it does not wait for data
            if time.monotonic() >= end:
                break


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


@pytest.mark.parametrize(
    ("step", "bound"),
    [(0.0, "data"), (0.25, "trainer")],
)
def test_the_load_follows_what_the_trainer_waits_for(
    photos: Path, start_service: ServiceFactory, step: float, bound: str
) -> None:
    """NOTE [ Fleet load ]: a loop that only pulls waits on one decode worker, which is always busy:
    the load asks for more services. A loop whose step is slower than decoding never waits and the
    worker idles: the load says fewer would do, however busy it was a moment before."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, workers=1, batch_size=8, metrics_port=port, heartbeat_interval=0.25)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        train_for(loader, 4.0, step)
        stats = loader.stats()
        text = scrape(port)
    names = ("dataferry_load ", "dataferry_decode_busy ", "dataferry_demand ")
    load, busy, demand = (sample(text, name) for name in names)
    waited_share = stats["waited_s"] / (stats["waited_s"] + stats["computed_s"])
    if bound == "data":
        assert waited_share > 0.5, f"the loop itself saw that it waited: {stats}"
        assert demand > 2 and busy > 0.6 and load > 1.5, f"more services asked for: {text}"
    else:
        assert waited_share < 0.2, f"the loop itself saw that it computed: {stats}"
        assert demand < 1.3 and busy < 0.5 and load < 0.6, f"fewer services would do: {text}"
    assert load == pytest.approx(busy * demand, abs=0.01)


# --- a trainer cannot invent demand (issue 35) --------------------------------------------------

CLAIMED_WAIT = 100.0
"""Seconds the lying trainer says its loop waited for each second that passes."""


def lie(endpoint: str, stop: threading.Event, attached: threading.Event) -> None:
    """A trainer that attaches, starts an epoch, pulls nothing (it holds the batches it is sent and
    never releases one), and says in every heartbeat that its loop waited ``CLAIMED_WAIT`` s a
    second and computed 1 ms: a demand of 10 (``MAX_DEMAND``) by its word."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode(Hello("liar", os.getpid() + 1, "", credits=2)))
        assert sock.poll(10_000), "no welcome"
        welcome = decode(sock.recv(), (Welcome, ErrorReply))
        assert isinstance(welcome, Welcome), welcome
        sock.send(encode(Start(1, 0, 0, token=welcome.token)))
        attached.set()
        began = time.monotonic()
        while not stop.wait(0.2):
            seconds = time.monotonic() - began
            claims = Heartbeat(
                welcome.token, waited=int(seconds * CLAIMED_WAIT * 1000), computed=int(seconds)
            )
            sock.send(encode(claims), zmq.NOBLOCK)
            while sock.poll(0):
                decode(sock.recv(), (BatchReady, EpochEnd, Heartbeat, ErrorReply))  # held, never released
    finally:
        sock.close(linger=0)
        ctx.term()


@contextlib.contextmanager
def lying_trainer(endpoint: str) -> Iterator[None]:
    stop, attached = threading.Event(), threading.Event()
    thread = threading.Thread(target=lie, args=(endpoint, stop, attached), daemon=True)
    thread.start()
    try:
        assert attached.wait(15), "the lying trainer never attached"
        yield
    finally:
        stop.set()
        thread.join(10)


def test_a_trainer_that_claims_it_waits_and_pulls_nothing_does_not_move_the_load(
    photos: Path, start_service: ServiceFactory
) -> None:
    """NOTE [ Fleet load ]: beside an honest trainer whose step is slower than decoding (it never
    waits), one that pulls nothing and claims its loop waited 100 s a second. Before, the service
    exported the liar's word: demand 10.0 and the load ten times the workers' busy share (0.54-0.60
    where the honest trainer alone makes it 0.06-0.08). Now the liar's wait counts only while the
    service saw it starved (until its two batches came), its compute at least the rest of its
    time in the epoch, and it counts by the two batches it took against the honest trainer's
    dozens: the demand is the honest trainer's (1.10-1.13 alone, 1.13-1.33 beside the liar)."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, workers=1, batch_size=8, metrics_port=port, heartbeat_interval=0.25)
    with lying_trainer(service.endpoint), ServiceLoader(service.endpoint, timeout=30) as loader:
        train_for(loader, 5.0, 0.25)
        stats = loader.stats()
        text = scrape(port)
    names = ("dataferry_load ", "dataferry_decode_busy ", "dataferry_demand ")
    load, busy, demand = (sample(text, name) for name in names)
    waited_share = stats["waited_s"] / (stats["waited_s"] + stats["computed_s"])
    assert waited_share < 0.2, f"the honest trainer computes: {stats}"
    assert 'client="liar"' in text, "the liar was attached while the load was measured"
    assert demand < 1.5, f"the honest trainer's demand, not the liar's 10: {load=} {busy=} {demand=}"
    assert load == pytest.approx(busy * demand, abs=0.01)
