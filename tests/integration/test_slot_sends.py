"""A remote trainer's batch is sent straight from shared memory: the slot must not be reused before
ZeroMQ is done reading it. Real sockets, a real mapping, a peer that does not read."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import zmq

from loader_service.supervisor.service import send_from_slot
from loader_service.supervisor.slots import SlotPool

pytestmark = pytest.mark.integration
IMAGES = 64 * 2**20
"""Far more than the socket buffers hold, so a peer that does not read leaves most of it unsent."""


@pytest.fixture
def pair(tmp_path: object) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    dealer.setsockopt(zmq.RCVHWM, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")  # the router learns the peer's routing id
    assert router.poll(10_000)
    router.recv_multipart()
    try:
        yield router, dealer
    finally:
        ctx.destroy(linger=0)


def test_the_slot_stays_out_of_the_pool_until_the_peer_has_read_the_images(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    router, dealer = pair
    region = mmap.mmap(-1, IMAGES + 16)
    try:
        view = memoryview(region)
        pool = SlotPool(1)
        slot = pool.acquire()
        assert slot is not None
        sent = send_from_slot(
            router, b"peer", b"batch", [view[:IMAGES], view[IMAGES : IMAGES + 8], view[IMAGES + 8 :]]
        )
        pool.track(slot, sent)
        pool.release(slot)  # the trainer's session ended; ZeroMQ is still sending
        assert not sent.done and pool.acquire() is None, "the slot is still being read by ZeroMQ"
        parts = dealer.recv_multipart()
        assert [len(p) for p in parts] == [5, IMAGES, 8, 8]
        sent.wait(10)  # raises NotDone if the send never finishes after the peer read it
        assert pool.acquire() == slot
        del view
    finally:
        region.close()
