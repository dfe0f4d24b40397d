"""The service seen from a raw ZeroMQ socket: credits, refusals, and serving on after bad traffic."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gpu_worker import ServiceLoader
from protocol.messages import (
    MAX_FRAME_BYTES,
    BatchReady,
    EpochEnd,
    ErrorReply,
    Heartbeat,
    Hello,
    Message,
    Release,
    Start,
    Welcome,
    decode,
    encode,
)
from tests.helpers import ServiceFactory

pytestmark = pytest.mark.integration
FROM_SERVICE = (Welcome, BatchReady, EpochEnd, ErrorReply, Heartbeat)


@pytest.fixture
def dealer(start_service: ServiceFactory, photos: Path) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    service = start_service(photos, slots=8)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        yield sock, service.endpoint
    finally:
        sock.close(linger=0)
        ctx.term()


def receive(sock: zmq.Socket[bytes], timeout: float, skip_heartbeats: bool = True) -> Message | None:
    """The next non-heartbeat message within ``timeout`` seconds, or None."""
    deadline = time.monotonic() + timeout
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        msg = decode(sock.recv(), FROM_SERVICE)
        if not (skip_heartbeats and isinstance(msg, Heartbeat)):
            return msg
    return None


def test_service_never_has_more_batches_out_than_granted(dealer: tuple[zmq.Socket[bytes], str]) -> None:
    sock, _ = dealer
    sock.send(encode(Hello("raw", 1, "", credits=2)))
    assert isinstance(receive(sock, 10), Welcome)
    sock.send(encode(Start(1, 0, 0)))
    first, second = receive(sock, 10), receive(sock, 10)
    assert isinstance(first, BatchReady) and isinstance(second, BatchReady)
    assert (first.seq, second.seq) == (0, 1)
    # Two workers and eight free slots could fill more; credits must hold the third back.
    assert receive(sock, 1.5) is None
    sock.send(encode(Release((first.lease,))))
    third = receive(sock, 10)
    assert isinstance(third, BatchReady) and third.seq == 2


def test_bad_traffic_is_refused_and_others_are_still_served(dealer: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = dealer
    for junk in (b"\x00\x01garbage", b"\x93\x01\x02\x03", encode(Start(1, 0, 0))):
        sock.send(junk)
        reply = receive(sock, 10)
        assert isinstance(reply, ErrorReply), junk
    sock.send_multipart([b"two", b"frames"])
    assert isinstance(receive(sock, 10), ErrorReply)
    sock.send(encode(Hello("raw", 1, "", credits=2)))
    assert isinstance(receive(sock, 10), Welcome)
    sock.send(encode(Release((123456, 7))))  # leases never given to this session: ignored
    with ServiceLoader(endpoint, timeout=30) as loader:
        assert sum(len(b.indices) for b in loader) == loader.info.samples


def test_an_oversized_frame_cuts_off_only_its_sender(dealer: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = dealer
    sock.send(b"\x81" + b"\x00" * (MAX_FRAME_BYTES * 2))  # ZMQ_MAXMSGSIZE drops this peer's connection
    with ServiceLoader(endpoint, timeout=30) as loader:
        assert sum(len(b.indices) for b in loader) == loader.info.samples
