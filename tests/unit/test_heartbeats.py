"""NOTE [ Early heartbeat ]: a session's beats as a real ZeroMQ socket receives them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gpu_worker.heartbeats import EARLY, Heartbeats
from protocol.codec import decode
from protocol.messages import Heartbeat


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/beats.sock"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close(linger=0)
    ctx.term()


def arrivals(sock: zmq.Socket[bytes], count: int, timeout: float) -> list[float]:
    """When each of the next ``count`` heartbeats arrived."""
    times = []
    deadline = time.monotonic() + timeout
    while len(times) < count and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        _peer, frame = sock.recv_multipart()
        assert decode(frame, (Heartbeat,)).token == "t" * 32
        times.append(time.monotonic())
    return times


def test_the_second_beat_comes_early_then_one_every_interval(router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = router
    beats = Heartbeats()
    try:
        start = time.monotonic()
        beats.beat("session", endpoint, "t" * 32, 1.0, None)
        first, second, third = arrivals(sock, 3, timeout=5.0)
    finally:
        beats.close()
    assert first - start < EARLY, "the first beat goes at once"
    assert EARLY * 0.8 <= second - first < 0.8, "the second a quarter second after it, not an interval"
    assert third - second >= 0.9, "then one every interval"
