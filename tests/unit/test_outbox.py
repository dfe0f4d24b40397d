"""The outbox without sockets: what is owed to a trainer is sent again until it goes out."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from loader_service.dataset.sampler import ShardOrder, shard_order
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.rates import FeedCounters
from loader_service.supervisor.slots import SlotPool, SlotState
from loader_service.supervisor.streams.stream import Stream
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.outbox import Outbox
from loader_service.supervisor.trainers.sends import SendBudget
from loader_service.supervisor.trainers.sessions import Session
from protocol.messages import BatchReady, EpochEnd, Hello, Message


@dataclass
class FeedStub:
    """One batch of four samples an epoch, with a real slot pool."""

    batch_size: int = 4
    samples: int = 4
    name: str = "stub"
    id: int = 0
    pool: SlotPool = field(default_factory=lambda: SlotPool(4))
    counters: FeedCounters = field(default_factory=FeedCounters)

    @property
    def config(self) -> Any:
        return self

    @property
    def sources(self) -> Any:
        """A feed of one source: nothing to count by source (NOTE [ Source ledger ])."""
        return SimpleNamespace(offsets=np.array([0, self.samples]))

    def shard_batches(self, world_size: int, remainder: str, offset: int = 0, samples: int = 0) -> int:
        return 1

    def plan(
        self, epoch: int, rank: int, world_size: int, remainder: str, offset: int = 0, order: object = None
    ) -> ShardOrder:
        return shard_order(0, epoch, self.samples, rank, world_size, remainder, offset)


class FlakyPeer:
    """A send function whose peer refuses the first message of each kind named in ``refuse``."""

    def __init__(self, *refuse: type[Message]) -> None:
        self.refuse = set(refuse)
        self.sent: list[Message] = []

    def __call__(self, routing_id: bytes, msg: Message) -> bool:
        if type(msg) in self.refuse:
            self.refuse.discard(type(msg))
            return False
        self.sent.append(msg)
        return True

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.sent if type(m).__name__ != "Heartbeat"]


def no_frames(routing_id: bytes, msg: Message, frames: list[memoryview]) -> None:
    raise AssertionError("a local trainer is never sent pixels")


def one_decoded_batch(peer: FlakyPeer) -> tuple[Outbox, Stream, FeedStub, Session]:
    feed = FeedStub()
    attached = Attachments()
    session = Session(b"t", "s1", Hello("t", 1, credits=3, mode="shard"), 0, 0.0)
    attached.add(session)
    stream = attached.stream_for(session, cast(Feed, feed), None)
    stream.add(session)
    stream.on_start("s1", 0, 0)
    slot = feed.pool.acquire()
    assert slot is not None
    gen, seq, _ = stream.plan_batch()
    assert stream.complete(gen, seq, slot, 4) is stream
    return Outbox(peer, no_frames, attached, 1.0, SendBudget(0)), stream, feed, session


def test_an_epoch_end_that_could_not_be_sent_is_sent_on_the_next_round() -> None:
    peer = FlakyPeer(EpochEnd)
    outbox, stream, _feed, _session = one_decoded_batch(peer)
    outbox.deliver(stream)
    assert peer.kinds() == ["BatchReady"], "the epoch end did not go out"
    outbox.heartbeat(now=10.0)
    assert peer.kinds() == ["BatchReady", "EpochEnd"], "owed, so sent again"
    outbox.heartbeat(now=20.0)
    assert peer.kinds() == ["BatchReady", "EpochEnd"], "and only once"


def test_an_announcement_that_could_not_be_sent_leases_nothing_until_it_goes_out() -> None:
    peer = FlakyPeer(BatchReady)
    outbox, stream, feed, session = one_decoded_batch(peer)
    outbox.deliver(stream)
    assert peer.kinds() == [] and not session.leases
    assert feed.pool.counts()["ready"] == 1
    outbox.heartbeat(now=10.0)
    assert peer.kinds() == ["BatchReady", "EpochEnd"]
    (announced,) = [m for m in peer.sent if isinstance(m, BatchReady)]
    assert list(session.leases) == [announced.lease]
    assert feed.pool.state(announced.slot) is SlotState.LEASED
