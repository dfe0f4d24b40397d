"""One trainer's share of the slot pool and of /dev/shm (issue 45): a peer that asks every credit
and releases nothing holds at most its share, the pool stops growing above a floor of /dev/shm, and
the slots it held are given back once it has gone. Real services; the peer is a raw ZeroMQ socket.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpu_worker import ServiceLoader
from loader_service.config import FIRST_SLOTS
from loader_service.config.feed import AUTO_MOST_SLOTS
from loader_service.supervisor.streams.early import WARM_BATCHES
from protocol.codec import decode, encode
from protocol.layout import PAGE, SlotLayout
from protocol.messages import (
    MAX_CREDITS,
    BatchReady,
    EpochEnd,
    ErrorReply,
    Heartbeat,
    Hello,
    Start,
    Welcome,
)
from tests.helpers import (
    ServiceFactory,
    in_background,
    pool_bytes,
    private_shm_available,
    slot_reserve,
    status,
    wait_until,
)

pytestmark = pytest.mark.integration
FROM_SERVICE = (Welcome, BatchReady, EpochEnd, ErrorReply, Heartbeat)
CREDITS = 6
"""The trainer's credits (ServiceLoader's default)."""
STARVED = 10.0
"""Seconds without a batch that count as starved: a batch of one 32 px image takes milliseconds."""


class Hoarder:
    """A peer that asks every credit the wire allows and takes every batch it is sent, epoch after
    epoch from epoch 1 (epoch 0's first batches, the warm start's, stay for the trainer), releasing
    none: it holds as many slots as it is granted. It heartbeats on its own connection, and leaves
    without a bye (its socket closes), as a killed or hostile peer does."""

    def __init__(self, endpoint: str, transport: str = "shm") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._sock.send(encode(Hello(client="hoarder", pid=os.getpid(), credits=MAX_CREDITS)))
        assert self._sock.poll(10_000), "no welcome"
        welcome = decode(self._sock.recv_multipart()[0], (Welcome,))
        self.credits, self.session, self._token = welcome.credits, welcome.session, welcome.token
        self.held = 0
        """Batches announced to it: every one is still held."""
        self.refused: list[str] = []
        self._transport = transport
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hoard, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _hoard(self) -> None:
        run, beat = 1, 0.0
        self._sock.send(encode(Start(run, run, 0, self._transport, token=self._token)))
        while not self._stop.is_set():
            if time.monotonic() - beat > 0.3:
                self._sock.send(encode(Heartbeat(self._token)))
                beat = time.monotonic()
            if not self._sock.poll(100):
                continue
            msg = decode(self._sock.recv_multipart()[0], FROM_SERVICE)  # a tcp batch's copies follow
            if isinstance(msg, BatchReady):
                self.held += 1
            elif isinstance(msg, EpochEnd) and msg.run == run:  # the next epoch, holding this one's
                run += 1
                self._sock.send(encode(Start(run, run, 0, self._transport, token=self._token)))
            elif isinstance(msg, ErrorReply):
                self.refused.append(msg.message)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._ctx.destroy(linger=0)


class Hoarding:
    """A ``Hoarder`` for a ``with`` block: closed on the way out, pass or fail."""

    def __init__(self, endpoint: str, transport: str = "shm", start: bool = True) -> None:
        self.peer = Hoarder(endpoint, transport)
        if start:
            self.peer.start()

    def __enter__(self) -> Hoarder:
        return self.peer

    def __exit__(self, *exc: object) -> None:
        self.peer.close()


def pool_size(body: dict[str, Any]) -> int:
    return sum(body["feeds"][0]["slots"].values())


def session_of(body: dict[str, Any], session: str) -> dict[str, Any]:
    (found,) = [s for s in body["sessions"] if s["session"] == session]
    return dict(found)


def hoards_all(endpoint: str, peer: Hoarder) -> None:
    """Wait until the peer holds every batch its credits allow, or the pool has no slot left (the
    service's count, and its own)."""

    def holds() -> bool:
        body = status(endpoint)
        feed, mine = body["feeds"][0], session_of(body, peer.session)
        everything = pool_size(body) == feed["slots_most"] and feed["slots"]["free"] == 0  # no more
        return peer.held == mine["leased"] and (mine["leased"] == peer.credits or bool(everything))

    wait_until(holds, f"the peer holds its {peer.credits} credits' worth, or every slot", timeout=90)


class Steps:
    """A trainer that takes batch after batch on a thread, noting the longest wait for one, until
    stopped; while ``going`` is clear it keeps every batch its credits allow, and rests."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.taken = 0
        self.longest = 0.0
        self.stop = threading.Event()
        self.going = threading.Event()
        self.going.set()
        self.resting = threading.Event()

    def run(self) -> int:
        kept: list[object] = []
        with ServiceLoader(self.endpoint, credits=CREDITS, timeout=3 * STARVED) as loader:
            last = time.monotonic()
            while not self.stop.is_set():
                for batch in loader:
                    now = time.monotonic()
                    self.longest, last = max(self.longest, now - last), now
                    self.taken += 1
                    if not self.going.is_set():
                        kept.append(batch)
                        if len(kept) < CREDITS:
                            continue
                        self.resting.set()
                        assert self.going.wait(12 * STARVED), "never told to go on"
                        kept.clear()
                        last = time.monotonic()
                    if self.stop.is_set():
                        break
        return self.taken

    def take(self, batches: int, what: str) -> None:
        target = self.taken + batches
        wait_until(lambda: self.taken >= target, what, timeout=6 * STARVED)


def test_a_peer_asking_every_credit_cannot_starve_another_trainer(
    photos: Path, start_service: ServiceFactory
) -> None:
    """The peer attaches first and takes what it is granted. Before the cap it was granted the whole
    pool (256 slots) and the trainer that came next got no batch at all."""
    service = start_service(photos, batch_size=1)
    with Hoarding(service.endpoint) as greedy:
        hoards_all(service.endpoint, greedy)
        with ServiceLoader(service.endpoint, credits=CREDITS, timeout=3 * STARVED) as trainer:
            longest, last = 0.0, time.monotonic()
            for _epoch in range(2):
                for _batch in trainer:
                    now = time.monotonic()
                    longest, last = max(longest, now - last), now
            body = status(service.endpoint)
        assert not greedy.refused
    assert longest < STARVED, f"the trainer waited {longest:.1f} s for a batch"
    assert pool_size(body) <= greedy.credits + CREDITS + WARM_BATCHES, "the pool holds the two shares"
    mine, feed = session_of(body, greedy.session), body["feeds"][0]
    assert greedy.credits == mine["credits"] == feed["credits_most"] == AUTO_MOST_SLOTS // 2, (
        "half of what the pool may reach (NOTE [ Credits per session ])"
    )
    assert mine["credits_asked"] == MAX_CREDITS


def test_the_pool_gives_back_what_a_peer_held_once_it_is_gone(
    photos: Path, start_service: ServiceFactory
) -> None:
    """A trainer is running; a peer takes its credits' worth and vanishes. Its slots come back, the
    pool gives them back to /dev/shm, and the trainer is served throughout. (The trainer rests with
    every batch its credits allow while the peer fills up, so every slot above the trainer's was
    the peer's: a trainer on this host keeps every slot up to the highest it was handed, which it
    may have pinned, until it leaves: NOTE [ Giving slots back ].)"""
    service = start_service(photos, batch_size=1, client_timeout=4)  # the pool looks every 8 s
    stride = slot_reserve(1, 32)  # what each slot reserves: no trainer here decodes encoded rows
    trainer = Steps(service.endpoint)
    with in_background(trainer.run, "the trainer") as outcome:
        try:
            trainer.take(5, "the trainer's first batches")
            trainer.going.clear()
            assert trainer.resting.wait(3 * STARVED), "the trainer holds every batch its credits allow"
            with Hoarding(service.endpoint) as greedy:
                hoards_all(service.endpoint, greedy)
                grown = pool_size(status(service.endpoint))
                assert grown > greedy.credits
                trainer.going.set()
                trainer.take(200, "two epochs of the trainer beside the peer")  # 90 batches an epoch
            # Gone without a bye: its leases come back when its heartbeats are missed.
            wait_until(lambda: status(service.endpoint)["attached"] == 1, "the peer's session expired")
            wait_until(
                lambda: pool_size(status(service.endpoint)) <= 2 * (CREDITS + WARM_BATCHES),
                f"the pool of {grown} slots given back down to what the trainer uses",
                timeout=60,
            )
            body = status(service.endpoint)
            assert body["feeds"][0]["pool_given_back"] >= grown - pool_size(body)
            assert pool_bytes(service.proc.pid) == pool_size(body) * stride + PAGE, "/dev/shm has it back"
            trainer.take(100, "the trainer after the pool was given back")
        finally:
            trainer.stop.set()
            trainer.going.set()
        outcome.result(60)
    assert trainer.longest < STARVED, f"the trainer waited {trainer.longest:.1f} s for a batch"
    wait_until(
        lambda: pool_size(status(service.endpoint)) == FIRST_SLOTS,
        "the pool back to its first slots once nobody uses it",
        timeout=60,
    )
    assert pool_bytes(service.proc.pid) == FIRST_SLOTS * stride + PAGE


needs_private_shm = pytest.mark.skipif(
    not private_shm_available(), reason="unshare --mount needs root or user namespaces here"
)


@needs_private_shm
def test_the_pool_stops_growing_above_a_floor_of_dev_shm(photos: Path, start_service: ServiceFactory) -> None:
    """The service gets a /dev/shm of its own, 16 MiB (tests.helpers.PRIVATE_SHM). Once the peer
    has attached, another job takes all but two slots' worth of what is free above the floor; the
    peer's share would need more. The pool grows by those two and no further, counted and logged,
    and the floor stays free: the other job can still allocate it. Before the floor the pool grew
    until /dev/shm was full and the other job's allocation failed with ENOSPC."""
    # No room for encoded rows: slots of one size, so "two slots' worth" is two slots.
    service = start_service(photos, private_shm=True, batch_size=8, image_size=104, encoded_row_bytes=0)
    shm = Path(f"/proc/{service.proc.pid}/root/dev/shm")  # the service's own /dev/shm
    stride = SlotLayout.images(8, 104).stride
    space = status(service.endpoint)["shm"]
    floor = space["floor_bytes"]
    assert (space["size_bytes"], floor) == (16 * 2**20, 4 * 2**20), "16 MiB: a quarter, under 64 MiB"
    with Hoarding(service.endpoint, transport="tcp", start=False) as greedy:
        other_job = shm / "other-job"
        fd = os.open(other_job, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            room = status(service.endpoint)["shm"]["free_bytes"] - floor
            os.posix_fallocate(fd, 0, room - 2 * stride)  # the other job grows meanwhile
            assert greedy.credits > FIRST_SLOTS + 2, "its share needs more than the two slots left"
            greedy.start()
            wait_until(
                lambda: status(service.endpoint)["feeds"][0].get("pool_refused", 0) > 0,
                "the pool's growth stopped",
                timeout=60,
            )
            service.wait_for(r"pool not grown past \d+ slots: /dev/shm")
            body = status(service.endpoint)
            assert pool_size(body) <= FIRST_SLOTS + 2
            assert body["shm"]["free_bytes"] >= floor, "growth never eats into the floor"
            os.posix_fallocate(fd, room - 2 * stride, floor)  # the other job takes the floor too
            assert not greedy.refused
        finally:
            os.close(fd)
            other_job.unlink(missing_ok=True)
