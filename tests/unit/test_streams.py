"""Stream bookkeeping without processes: broadcast barriers, refusals, slot freeing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from loader_service.dataset.sampler import ShardOrder, shard_order
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.broadcast import BroadcastStream
from loader_service.supervisor.streams.shard import ShardStream
from loader_service.supervisor.streams.stream import StartRefused, Stream
from loader_service.supervisor.trainers.sessions import Session
from protocol.messages import Hello


class PoolStub:
    """Records the slots a stream frees, in order."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def release(self, slot: int) -> None:
        self.freed.append(slot)


@dataclass
class FeedStub:
    """What a Stream (and its early batches ahead) asks of its feed."""

    batch_size: int = 4
    samples: int = 10
    name: str = "stub"
    pool: PoolStub = field(default_factory=PoolStub)

    @property
    def config(self) -> Any:
        return self

    def shard_batches(self, world_size: int, remainder: str, offset: int = 0, samples: int = 0) -> int:
        return -(-(self.samples - offset) // self.batch_size)

    def plan(
        self, epoch: int, rank: int, world_size: int, remainder: str, offset: int = 0, order: object = None
    ) -> ShardOrder:
        return shard_order(0, epoch, self.samples, rank, world_size, remainder, offset)


def first_batch() -> list[int]:
    """What the stub feed's epoch 0 starts with, for a group (one shard of the whole epoch)."""
    stub = FeedStub()
    return stub.plan(0, 0, 1, "pad").batch(0, stub.batch_size).tolist()


def freed(stream: Stream) -> list[int]:
    return cast(FeedStub, stream.feed).pool.freed


def session(sid: str, mode: str = "broadcast", group_size: int = 2, credits: int = 3) -> Session:
    hello = Hello("t", 1, credits=credits, mode=mode, group="g", group_size=group_size)
    return Session(sid.encode(), sid, hello, 0, 0.0)


def group(*sids: str, group_size: int = 2) -> BroadcastStream:
    first = session(sids[0], group_size=group_size)
    stream = BroadcastStream(("broadcast", 0, "g"), cast(Feed, FeedStub()), first, None)
    for sid in sids:
        stream.add(session(sid, group_size=group_size))
    return stream


def test_first_epoch_waits_for_group_size() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    assert not stream.wants_batch()
    stream.on_start("b", 0, 0)
    assert stream.wants_batch() and stream.epoch == 0


def test_members_must_agree_on_epochs() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    with pytest.raises(StartRefused, match="must start the same epoch"):
        stream.on_start("b", 3, 0)
    stream.on_start("b", 0, 0)
    with pytest.raises(StartRefused, match="next one is 1"):
        stream.on_start("a", 5, 0)


def test_batch_slot_is_freed_when_every_member_released_it() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    stream.on_start("b", 0, 0)
    gen, seq, indices = stream.plan_batch()
    assert indices.tolist() == first_batch()
    assert stream.filled(gen, seq, slot=7, count=4)
    for sid in ("a", "b"):
        assert [key for key, _ in stream.deliverable(stream.members[sid])] == [(gen, seq)]
    stream.release("a", (gen, seq))
    assert freed(stream) == []
    stream.release("b", (gen, seq))
    assert freed(stream) == [7]


def test_evicted_member_keeps_its_slot_but_stops_counting() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    stream.on_start("b", 0, 0)
    gen, seq, _ = stream.plan_batch()
    stream.filled(gen, seq, slot=1, count=4)
    for sid in ("a", "b"):
        list(stream.deliverable(stream.members[sid]))
    stream.release("a", (gen, seq))
    assert stream.in_flight == 1
    stream.evict("b")
    assert freed(stream) == [], "b still reads slot 1"
    assert stream.in_flight == 0, "the group's window is free again"
    stream.release("b", (gen, seq))
    assert freed(stream) == [1]


def test_a_laggard_is_named_once_it_has_held_a_full_window_past_the_patience() -> None:
    """NOTE [ Broadcast epochs ]: ``b`` never takes the window's batches that ``a`` has taken and
    released; it is named after ``patience`` seconds of that, once, and the clock starts again."""
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    stream.on_start("b", 0, 0)
    for slot in range(stream.window):
        gen, seq, _ = stream.plan_batch()
        stream.filled(gen, seq, slot=slot, count=4)
        list(stream.deliverable(stream.members["a"]))
        stream.release("a", (gen, seq))
    assert stream.to_evict(100.0, 5.0) == [], "the clock starts"
    assert stream.to_evict(104.0, 5.0) == []
    assert stream.to_evict(105.5, 5.0) == [("b", "held")]
    assert stream.to_evict(106.0, 5.0) == [], "named once; the clock starts again"


def test_a_member_that_never_starts_is_named_while_the_others_wait() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)  # a waits for b to begin the group's first epoch
    t = time.monotonic()  # a member's patience counts from when it attached, too
    assert stream.to_evict(t, 5.0) == []
    assert stream.to_evict(t + 5.5, 5.0) == [("b", "never started, holding")]
    shard = ShardStream(("shard", "a"), cast(Feed, FeedStub()), session("a", mode="shard"), None)
    assert shard.to_evict(1e9, 5.0) == [], "a shard trainer holds no one up"


def test_shard_restart_drops_undelivered_batches() -> None:
    stream = ShardStream(("shard", "a"), cast(Feed, FeedStub()), session("a", mode="shard"), None)
    stream.add(session("a", mode="shard"))
    stream.on_start("a", 0, 0)
    gen, seq, _ = stream.plan_batch()
    stream.filled(gen, seq, slot=2, count=4)
    stream.on_start("a", 1, 0)
    assert freed(stream) == [2], "the unannounced batch's slot is freed"
    assert not stream.filled(gen, seq + 1, slot=3, count=4), "a late batch of the old plan is refused"


def test_members_resuming_at_different_positions_each_get_their_own_rest() -> None:
    stream = group("a", "b")
    stream.on_start("a", 2, 1)
    stream.on_start("b", 2, 2)
    assert stream.next_produce == 1, "the group decodes from the earliest position"
    first = stream.plan_batch()
    assert stream.filled(first[0], first[1], slot=0, count=4)
    assert [k for k, _ in stream.deliverable(stream.members["a"])] == [(first[0], 1)]
    assert list(stream.deliverable(stream.members["b"])) == [], "b had seen batch 1 already"
    stream.release("a", (first[0], 1))
    assert freed(stream) == [0]


def test_next_epoch_takes_the_batches_decoded_ahead_and_those_still_decoding() -> None:
    # 10 samples in batches of 4: 3 batches an epoch; the trainer has 3 credits.
    stream = ShardStream(("shard", "a"), cast(Feed, FeedStub()), session("a", mode="shard"), None)
    stream.add(session("a", mode="shard"))
    stream.on_start("a", 0, 0)
    for slot in range(3):
        gen, seq, _ = stream.plan_batch()
        assert stream.filled(gen, seq, slot=slot, count=4)
    for key, _batch in list(stream.deliverable(stream.members["a"])):
        stream.release("a", key)  # the trainer consumed epoch 0; slots 0-2 are free again
    ahead = stream.ahead
    assert ahead is not None and stream.wants_ahead()
    first, second = ahead.plan_batch(), ahead.plan_batch()
    assert ahead.filled(first[0], first[1], slot=5, count=4)  # the second is still decoding

    already = list(freed(stream))
    stream.on_start("a", 1, 0)
    assert freed(stream) == already, "nothing decoded ahead is thrown away"
    assert stream.next_produce == 2 and stream.filling == 1, "neither batch is decoded again"
    assert ahead.filled(second[0], second[1], slot=6, count=4), "its completion reaches the stream"
    assert stream.filling == 0
    delivered = [(key[1], batch.slot) for key, batch in stream.deliverable(stream.members["a"])]
    assert delivered == [(0, 5), (1, 6)]


def test_a_handed_over_batch_finishing_after_another_restart_is_refused() -> None:
    stream = ShardStream(("shard", "a"), cast(Feed, FeedStub()), session("a", mode="shard"), None)
    stream.add(session("a", mode="shard"))
    stream.on_start("a", 0, 0)
    for slot in range(3):
        gen, seq, _ = stream.plan_batch()
        stream.filled(gen, seq, slot=slot, count=4)
    for key, _batch in list(stream.deliverable(stream.members["a"])):
        stream.release("a", key)
    ahead = stream.ahead
    assert ahead is not None
    late = ahead.plan_batch()
    stream.on_start("a", 1, 0)
    assert stream.filling == 1, "the batch still decoding is the stream's now"
    stream.on_start("a", 5, 0)  # the trainer jumps elsewhere before the batch is done
    assert not ahead.filled(late[0], late[1], slot=7, count=4), "its slot is freed, not delivered"
    assert stream.filling == 0 and not stream.batches


def test_a_member_that_resumed_its_session_goes_on_in_the_running_epoch() -> None:
    stream = group("a", "b")
    stream.on_start("a", 0, 0)
    stream.on_start("b", 0, 0)
    first = stream.plan_batch()
    assert stream.filled(first[0], first[1], slot=0, count=4)
    assert [k for k, _ in stream.deliverable(stream.members["a"])] == [(first[0], 0)]
    stream.on_start("a", 0, 1)  # a lost touch, resumed, and asks for its epoch from batch 1
    second = stream.plan_batch()
    assert stream.filled(second[0], second[1], slot=1, count=4)
    assert [k for k, _ in stream.deliverable(stream.members["a"])] == [(second[0], 1)]


def test_a_member_starting_after_the_last_active_one_left_gets_the_whole_epoch() -> None:
    """Found by the soak test: b attached while a was in the epoch and started only after a left.
    The group went on decoding the epoch for nobody, so b joined at its end and got nothing."""
    stream = group("a", group_size=1)
    stream.on_start("a", 0, 0)
    stream.add(session("b", group_size=1))
    gen, seq, _ = stream.plan_batch()
    assert stream.filled(gen, seq, slot=5, count=4)
    assert [key for key, _ in stream.deliverable(stream.members["a"])] == [(gen, seq)]
    late = stream.plan_batch()  # still decoding when a leaves
    stream.remove("a")
    stream.on_member_left()
    assert not stream.wants_batch(), "nobody is in the epoch: nothing more is decoded for it"
    assert not stream.filled(late[0], late[1], slot=6, count=4), "nor is a batch still decoding kept"
    stream.on_start("b", 0, 0)
    gen, seq, indices = stream.plan_batch()
    assert (seq, indices.tolist()) == (0, first_batch()), "b's epoch starts at its first batch"
    assert stream.filled(gen, seq, slot=7, count=4)
    assert [key for key, _ in stream.deliverable(stream.members["b"])] == [(gen, 0)]


def test_members_waiting_for_the_next_epoch_still_begin_it_when_the_laggard_leaves() -> None:
    stream = group("a", "b", "c", group_size=3)
    for sid in ("a", "b", "c"):
        stream.on_start(sid, 0, 0)
    stream.on_start("a", 1, 0)
    stream.on_start("b", 1, 0)
    stream.remove("c")
    stream.on_member_left()
    assert stream.epoch == 1 and stream.wants_batch(), "a and b go on to epoch 1 without c"


# --- picked runs (NOTE [ A fleet ] in gpu_worker/fleet_pass.py) ------------------------------------------


def picked(samples: int = 40, credits: int = 3) -> ShardStream:
    """A shard stream of 10 batches whose trainer has ``credits`` credits."""
    feed = FeedStub(samples=samples)
    stream = ShardStream(("shard", "a"), cast(Feed, feed), session("a", mode="shard", credits=credits), None)
    stream.add(session("a", mode="shard", credits=credits))
    return stream


def decode_all(stream: Stream) -> list[int]:
    """Plan and fill whatever the stream wants now; the seqs, in the order planned."""
    seqs = []
    while stream.wants_batch():
        gen, seq, _ = stream.plan_batch()
        assert stream.filled(gen, seq, slot=100 + seq, count=4)
        seqs.append(seq)
    return seqs


def test_a_picked_run_decodes_only_what_it_is_asked_for_lowest_first() -> None:
    """The lowest first, whatever the order named: a batch the trainer waits for and asks again of
    this service (a fleet's backup, NOTE [ A fleet ]) goes before those asked ahead of it."""
    stream = picked()
    stream.on_start("a", 0, 0, picked=(7, 2))
    assert decode_all(stream) == [2, 7]
    assert [key[1] for key, _ in stream.deliverable(stream.members["a"])] == [2, 7], "announced lowest first"
    stream.want((7, 2, 99, 4), limit=3)
    assert decode_all(stream) == [4], "a seq asked again or past the epoch is ignored"
    assert stream.members["a"].end_sent, "a picked run sends no end"


def test_a_picked_run_queues_no_more_than_the_trainer_s_credits() -> None:
    stream = picked()
    stream.on_start("a", 0, 0, picked=())
    stream.want(tuple(range(10)), limit=3)
    assert stream.picks is not None and list(stream.picks) == [0, 1, 2]
    stream.want((3, 4), limit=3)
    assert list(stream.picks) == [0, 1, 2], "the queue is full: the trainer names them again later"


def test_a_batch_let_go_may_be_asked_for_again() -> None:
    stream = picked()
    stream.on_start("a", 0, 0, picked=(0,))
    decode_all(stream)
    [(key, _)] = list(stream.deliverable(stream.members["a"]))
    stream.want((0,), limit=3)
    assert not stream.wants_batch(), "still leased: a repeat of the want is no new request"
    stream.release("a", key)
    stream.want((0,), limit=3)
    assert decode_all(stream) == [0], "let go unread (room made for another): decoded again"


def decoded_ahead(samples: int = 12, credits: int = 3) -> tuple[Stream, list[tuple[int, int, Any]]]:
    """A picked stream that asked for the whole of epoch 0 (3 batches), whose early batches ahead then
    planned the first two of epoch 1; nothing of epoch 1 decoded yet."""
    stream = picked(samples=samples, credits=credits)
    stream.on_start("a", 0, 0, picked=(0, 1, 2))
    decode_all(stream)
    for key, _batch in list(stream.deliverable(stream.members["a"])):
        stream.release("a", key)
    ahead = stream.ahead
    assert ahead is not None and stream.wants_ahead(), "the whole epoch was asked for: decode ahead"
    return stream, [ahead.plan_batch(), ahead.plan_batch()]


def test_a_picked_start_keeps_cached_batches_it_did_not_ask_for_and_announces_them_when_asked() -> None:
    """NOTE [ Kept batches ]: decoded ahead, not named by the start, announced at once when asked
    for later: never decoded twice."""
    stream, (first, second) = decoded_ahead()
    ahead = stream.ahead
    assert ahead is not None and ahead.filled(first[0], first[1], slot=5, count=4)
    already = list(freed(stream))
    stream.on_start("a", 1, 0, picked=(1,))  # this service was asked for batch 1 only
    assert ahead.filled(second[0], second[1], slot=6, count=4), "batch 1 reaches the stream"
    member = stream.members["a"]
    assert [(key[1], b.slot) for key, b in stream.deliverable(member)] == [(1, 6)], "only what it asked"
    assert freed(stream) == already, "batch 0, decoded ahead and not asked for, is kept"
    stream.want((0,), limit=3)
    assert decode_all(stream) == [], "asked for later: not decoded again"
    assert [(key[1], b.slot) for key, b in stream.deliverable(member)] == [(0, 5)]


def test_a_batch_still_decoding_that_the_start_passed_over_is_kept_too() -> None:
    stream, (first, second) = decoded_ahead()
    ahead = stream.ahead
    assert ahead is not None
    stream.on_start("a", 1, 0, picked=())  # asked for nothing yet, both still decoding
    assert ahead.filled(first[0], first[1], slot=5, count=4) and ahead.filled(second[0], second[1], 6, 4)
    assert list(stream.deliverable(stream.members["a"])) == []
    stream.want((1,), limit=3)
    assert decode_all(stream) == [] and [k[1] for k, _ in stream.deliverable(stream.members["a"])] == [1]


def kept_two() -> Stream:
    """Epoch 1 started asking for nothing, its first two batches decoded ahead into slots 5 and 6."""
    stream, planned = decoded_ahead()
    ahead = stream.ahead
    assert ahead is not None
    for (gen, seq, _), slot in zip(planned, (5, 6), strict=True):
        assert ahead.filled(gen, seq, slot, 4)
    stream.on_start("a", 1, 0, picked=())
    return stream


def test_kept_batches_give_their_slots_back_when_room_is_needed_or_the_plan_changes() -> None:
    stream = kept_two()
    already = list(freed(stream))
    assert stream.drop_kept() and freed(stream) == [*already, 5, 6], "the pool needed them"
    stream.want((0,), limit=3)
    assert decode_all(stream) == [0], "dropped, then asked for: decoded after all"
    stream = kept_two()
    already = list(freed(stream))
    stream.on_start("a", 2, 0, picked=())  # another plan: nothing kept survives it
    assert sorted(freed(stream)[len(already) :]) == [5, 6] and not stream.kept


def test_batches_decoded_ahead_never_keep_a_picked_run_from_what_it_asks_for() -> None:
    """The trainer cannot see what a service decodes ahead: a batch it asks for later (another
    service of its fleet was lost) must still be decoded, whatever the batches decoded ahead hold."""
    stream = picked(samples=12, credits=2)  # 3 batches an epoch, a window of 2
    stream.on_start("a", 0, 0, picked=(2,))  # the last batch: the next epoch may be decoded ahead
    decode_all(stream)
    ahead = stream.ahead
    assert ahead is not None and stream.wants_ahead()
    while stream.wants_ahead():
        gen, seq, _ = ahead.plan_batch()
        assert ahead.filled(gen, seq, slot=50 + seq, count=4)
    stream.want((0,), limit=2)
    assert stream.wants_batch(), "the batch asked for is decoded, not held back by the batches decoded ahead"
    assert decode_all(stream) == [0]
