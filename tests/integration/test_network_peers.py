"""Peers that do what the protocol allows, badly or on purpose: stop reading, send endless messages,
hold or break a broadcast group. Real services, real ZeroMQ sockets written by hand.
Run with the other network tests: ``pytest tests/integration -k network``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from protocol.messages import Heartbeat, Hello, Start, Welcome, decode, encode
from tests.helpers import ServiceFactory, epoch_indices, status

pytestmark = pytest.mark.integration


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll the service's own account (status) until ``condition``: there is no event to wait on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


class RawPeer:
    """A hand-made trainer: a DEALER that says hello, may start, and then does only what it is told;
    a second socket heartbeats for it, so only what it reads (or not) can give it away."""

    def __init__(self, endpoint: str, **hello: object) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        self.sock.send(encode(Hello("raw:1", 1, **hello)))  # type: ignore[arg-type]
        assert self.sock.poll(10_000), "no welcome"
        welcome = decode(self.sock.recv(), (Welcome,))
        self.token = welcome.token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(endpoint,), daemon=True)
        self._beat.start()

    def start(self, epoch: int = 0, transport: str = "tcp") -> None:
        self.sock.send(encode(Start(1, epoch, 0, transport, self.token)))

    def _heartbeat(self, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        while not self._stop.wait(0.2):
            sock.send(encode(Heartbeat(self.token)), zmq.NOBLOCK)
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._beat.join(5)
        self._ctx.destroy(linger=0)


@contextmanager
def raw_peer(endpoint: str, **hello: object) -> Iterator[RawPeer]:
    peer = RawPeer(endpoint, **hello)
    try:
        yield peer
    finally:
        peer.close()


def test_a_remote_peer_that_stops_reading_loses_its_slots_within_the_client_timeout(
    photos: Path, start_service: ServiceFactory
) -> None:
    """It asks for bytes over the socket (any peer may, even on the ipc socket), takes every slot of
    the pool, reads nothing and keeps heartbeating. Before NOTE [ Remote sends ] its slots stayed
    out of the pool as long as ZeroMQ was sending them, and the real trainer below timed out."""
    service = start_service(photos, image_size=160, slots=6, client_timeout=2)
    with raw_peer(service.endpoint, credits=6) as peer:
        peer.start()
        wait_until(lambda: status(service.endpoint)["sessions"][0]["leased"] == 6, "the peer holds the pool")
        with ServiceLoader(service.endpoint, timeout=15) as trainer:  # waits for the pool, no longer
            indices, _ = epoch_indices(trainer)
            body = status(service.endpoint)
    assert sorted(indices) == list(range(len(build_index(photos))))
    service.wait_for(r"session t1 \(raw:1\) detached: stopped reading")
    assert body["attached"] == 1, "the peer's session is gone, the trainer's is there"
    batch_bytes = 8 * 3 * 160 * 160 + 2 * 8 * 8  # images, labels, indices
    assert body["remote_send_bytes"] <= 6 * batch_bytes, "its copies stay within its credits"
