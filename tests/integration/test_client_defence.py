"""A trainer never maps or reads memory just because a message names it (a fake service tries)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from gpu_worker import ServiceError, ServiceLoader
from protocol.codec import decode, encode
from protocol.layout import SlotLayout
from protocol.messages import Ack, BatchReady, Bye, FeedInfo, Heartbeat, Hello, Release, Start, Want, Welcome
from tests.helpers import fake_segment

pytestmark = pytest.mark.integration
Script = Callable[[zmq.Socket[bytes], bytes], None]


def feed_info(segment: str, slots: int = 2) -> FeedInfo:
    return FeedInfo(
        "train", 8, 2, 4, 8, 2, 0, "train", "ff" * 16, segment, slots, SlotLayout.images(4, 8).wire()
    )


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    """Serve one trainer from a script: ``script(socket, routing_id)`` runs after its hello."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def start(script: Script) -> str:
        endpoint = f"ipc://{tmp_path}/fake{len(threads)}.sock"
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)

        def serve() -> None:
            try:
                while not stop.is_set():
                    if sock.poll(100):
                        routing_id, frame = sock.recv_multipart()
                        kinds = (Hello, Start, Want, Release, Ack, Heartbeat, Bye)
                        if isinstance(decode(frame, kinds), Hello):
                            script(sock, routing_id)
            finally:
                sock.close(linger=0)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return endpoint

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)
    ctx.term()


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        ("dataferry-../../etc/passwd", "not a dataferry shared-memory segment name"),
        ("/dev/zero", "not a dataferry shared-memory segment name"),
        ("dataferry-999999999-nothing-here", "No such file"),
    ],
)
def test_segment_names_from_the_wire_are_checked(
    fake_service: Callable[[Script], str], segment: str, message: str
) -> None:
    def welcome(sock: zmq.Socket[bytes], rid: bytes) -> None:
        sock.send_multipart([rid, encode(Welcome("s", feed_info(segment), 1.0, 2, 8))])

    with pytest.raises(ServiceError, match=message):
        ServiceLoader(fake_service(welcome), connect_timeout=10, transport="shm")


@pytest.fixture
def small_segment() -> Iterator[str]:
    """A real segment of ours holding exactly one slot."""
    with fake_segment(fill=7) as name:
        yield name


def test_a_pool_larger_than_its_segment_is_refused(
    fake_service: Callable[[Script], str], small_segment: str
) -> None:
    def welcome(sock: zmq.Socket[bytes], rid: bytes) -> None:
        sock.send_multipart([rid, encode(Welcome("s", feed_info(small_segment, slots=64), 1.0, 2, 8))])

    with pytest.raises(ServiceError, match="smaller than"):
        ServiceLoader(fake_service(welcome), connect_timeout=10, transport="shm")


def test_a_slot_outside_the_pool_is_refused(
    fake_service: Callable[[Script], str], small_segment: str
) -> None:
    def welcome_then_bad_slot(sock: zmq.Socket[bytes], rid: bytes) -> None:
        sock.send_multipart([rid, encode(Welcome("s", feed_info(small_segment, slots=1), 1.0, 2, 8))])
        sock.send_multipart([rid, encode(BatchReady(1, 0, 0, 1, 5, 4))])

    endpoint = fake_service(welcome_then_bad_slot)
    with (
        ServiceLoader(endpoint, connect_timeout=10, timeout=10) as loader,
        pytest.raises(ServiceError, match="invalid slot"),
    ):
        next(iter(loader))


def test_a_batch_the_service_leaves_out_is_asked_for_again(
    fake_service: Callable[[Script], str], small_segment: str
) -> None:
    """A service that leaves batch 1 out of what a picked start asked for, and announces batch 2:
    the loader keeps 2 waiting, names 1 again (``want``) and hands out 0, 1, 2 in order."""
    wants: list[tuple[int, ...]] = []
    leases = iter(range(1, 100))

    def serve(sock: zmq.Socket[bytes], rid: bytes) -> None:
        sock.send_multipart([rid, encode(Welcome("s", feed_info(small_segment, slots=1), 0.2, 3, 12))])
        while not wants or 1 not in wants[-1]:
            if not sock.poll(10_000):
                return
            _, frame = sock.recv_multipart()
            msg = decode(frame, (Hello, Start, Want, Release, Ack, Heartbeat, Bye))
            if isinstance(msg, Start):
                assert msg.picked and msg.want == (0, 1, 2)
                for seq in (0, 2):
                    batch = BatchReady(msg.run, msg.epoch, seq, next(leases), 0, 4)
                    sock.send_multipart([rid, encode(batch)])
                run = msg.run
            elif isinstance(msg, Want):
                wants.append(msg.seqs)
        sock.send_multipart([rid, encode(BatchReady(run, 0, 1, next(leases), 0, 4))])

    with ServiceLoader(fake_service(serve), connect_timeout=10, timeout=10, credits=4) as loader:
        got = [b.seq for b in loader]
    assert got == [0, 1, 2], "each batch once, in order"
    assert wants and wants[-1] == (1,), "only the batch that did not come is named again"
