"""A remote trainer's batch is sent as a copy of its slot, so a peer that does not read holds memory,
never the pool. Real sockets, a real mapping, a peer that does not read."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import zmq

from loader_service.supervisor.trainers.sends import SendBudget, send_copied

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


def test_a_remote_batch_is_a_copy_so_the_slot_is_free_while_the_peer_has_not_read_it(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    """NOTE [ Remote sends ]: the slot may be rewritten at once; the peer still gets the bytes as
    they were when sent, and the send is done only once ZeroMQ let the copy go."""
    router, dealer = pair
    region = mmap.mmap(-1, IMAGES + 16)
    try:
        view = memoryview(region)
        region[:4] = b"old!"
        budget = SendBudget(limit=2 * IMAGES)
        sent = send_copied(
            router, b"peer", b"batch", [view[:IMAGES], view[IMAGES : IMAGES + 8], view[IMAGES + 8 :]], budget
        )
        budget.add("peer", sent, IMAGES)
        region[:4] = b"new!"  # the slot reused while ZeroMQ still sends
        assert not sent.done, "a peer that does not read holds the copy, not the slot"
        parts = dealer.recv_multipart()
        assert [len(p) for p in parts] == [5, IMAGES, 8, 8]
        assert parts[1][:4] == b"old!"
        sent.tracker.wait(10)  # raises NotDone if the send never finishes after the peer read it
        budget.settle()
        assert budget.buffer(IMAGES) is sent.buffers[0], "its buffer is reused once ZeroMQ let it go"
        del view
    finally:
        region.close()
