from __future__ import annotations

import inspect

import pytest

from gpu_worker import ServiceLoader
from loader_service.shm import shm_floor
from loader_service.supervisor.slots import GROW_RETRY, SlotPool, SlotState, SlotStateError
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.sessions import SHARE_LEAST, Session, credit_cap
from protocol.messages import Hello

MIB = 2**20


def test_full_lifecycle_and_reuse() -> None:
    pool = SlotPool(2)
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None and a != b
    assert pool.acquire() is None, "never more slots than the pool holds"
    pool.filled(a)
    pool.lease(a)
    assert pool.state(a) is SlotState.LEASED
    pool.release(a)
    assert pool.free == 1 and pool.acquire() == a
    assert pool.counts() == {"free": 0, "filling": 2, "ready": 0, "leased": 0}


def test_forbidden_edges_raise() -> None:
    pool = SlotPool(1)
    slot = pool.acquire()
    assert slot is not None
    with pytest.raises(SlotStateError):
        pool.lease(slot)  # a FILLING slot can never be announced
    pool.release(slot)  # cancel
    with pytest.raises(SlotStateError):
        pool.release(slot)
    with pytest.raises(SlotStateError):
        pool.filled(slot)


def test_a_pool_grows_one_slot_at_a_time_up_to_its_capacity() -> None:
    pool = SlotPool(1, capacity=3)
    assert (len(pool), pool.capacity, pool.full) == (1, 3, False)
    assert pool.acquire() == 0 and pool.acquire() is None
    pool.add()
    assert pool.acquire() == 1, "the slot added is the next one, and free"
    pool.add()
    assert pool.full and len(pool) == 3
    with pytest.raises(SlotStateError):
        pool.add()
    assert pool.counts() == {"free": 1, "filling": 2, "ready": 0, "leased": 0}


def test_the_lowest_free_slot_is_handed_out_first() -> None:
    pool = SlotPool(4)
    assert [pool.acquire() for _ in range(4)] == [0, 1, 2, 3]
    for slot in (3, 1, 2):
        pool.release(slot)
    assert pool.acquire() == 1, "what is in use gathers at the bottom (NOTE [ Giving slots back ])"


class Memory:
    """A pool's backing that records what it reserved and gave back, and refuses when told to."""

    def __init__(self) -> None:
        self.room = True
        self.reserved: list[tuple[int, int]] = []
        self.returned: list[tuple[int, int]] = []

    def reserve(self, offset: int, nbytes: int) -> bool:
        if self.room:
            self.reserved.append((offset, nbytes))
        return self.room

    def give_back(self, offset: int, nbytes: int) -> None:
        self.returned.append((offset, nbytes))


def test_a_refused_growth_is_counted_and_tried_again_later() -> None:
    clock = [100.0]
    memory = Memory()
    pool = SlotPool(1, capacity=4, backing=memory, stride=10, clock=lambda: clock[0])
    assert pool.grow() and memory.reserved == [(10, 10)]
    memory.room = False
    assert not pool.grow() and pool.refused == 1 and len(pool) == 2
    memory.room = True
    assert not pool.grow() and pool.refused == 1, "not asked again within GROW_RETRY"
    clock[0] += GROW_RETRY
    assert pool.grow() and len(pool) == 3, "room others freed is the pool's again"


def test_a_slots_room_for_encoded_rows_is_reserved_only_once_a_batch_there_uses_it() -> None:
    """NOTE [ Encoded rows ]: 100 bytes a slot, the last 40 its room; a pool whose trainers decode
    nothing never holds that room, and a slot given back gives its room back with it."""
    clock = [0.0]
    memory = Memory()
    pool = SlotPool(1, capacity=4, backing=memory, stride=100, clock=lambda: clock[0], ahead=60)
    assert pool.grow() and memory.reserved == [(100, 60)], "a new slot without its room"
    assert pool.room(1) and pool.room(1) and memory.reserved == [(100, 60), (160, 40)], "once"
    memory.room = False
    assert not pool.room(0) and pool.room_refused == 1, "no room: that batch is decoded whole"
    memory.room = True
    assert pool.room(0) and memory.reserved[-1] == (60, 40)
    clock[0] += 100
    assert pool.give_back(clock[0], keep=0, after=10) == 1 and memory.returned == [(100, 100)]
    assert pool.grow() and pool.room(1) and memory.reserved[-2:] == [(100, 60), (160, 40)], "afresh"


def acquired(pool: SlotPool) -> int:
    slot = pool.acquire()
    assert slot is not None
    return slot


def test_a_pool_mostly_free_for_a_while_gives_back_its_top_free_slots() -> None:
    memory = Memory()
    pool = SlotPool(2, capacity=20, backing=memory, stride=10, clock=lambda: 0.0)
    taken = []
    for _ in range(16):
        if not pool.free:
            assert pool.grow()
        taken.append(acquired(pool))
    assert len(pool) == 16
    for slot in taken[1:]:
        pool.release(slot)
    assert pool.give_back(9.9, keep=0, after=10) == 0, "not before ``after``"
    assert pool.give_back(10.0, keep=0, after=10) == 0, "all 16 were in use since it last looked"
    assert pool.give_back(15.0, keep=0, after=10) == 0, "not again before ``after``"
    assert pool.give_back(20.0, keep=0, after=10) == 14, "down to its first size: 1 in use since"
    assert len(pool) == 2 and memory.returned == [(20, 140)] and pool.given_back == 14
    assert pool.counts() == {"free": 1, "filling": 1, "ready": 0, "leased": 0}
    assert pool.acquire() == 1 and pool.acquire() is None, "no slot beyond the pool is handed out"


def grown(size: int) -> SlotPool:
    """A pool that started with 2 slots and grew to ``size`` at time 0, every slot free."""
    pool = SlotPool(2, capacity=size, clock=lambda: 0.0)
    while pool.grow():
        pass
    assert len(pool) == size and pool.free == size
    return pool


def test_giving_back_keeps_twice_the_peak_in_use_and_what_a_trainer_may_have_pinned() -> None:
    pool = grown(20)
    for _ in range(3):
        acquired(pool)
    assert pool.give_back(10.0, keep=0, after=10) == 14, "down to 2 x 3, the most in use at once"
    pool = grown(20)
    for _ in range(3):
        acquired(pool)
    assert pool.give_back(10.0, keep=12, after=10) == 8, "never below the slots a trainer may have pinned"
    pool = grown(20)
    taken = [acquired(pool) for _ in range(20)]
    for slot in taken[:-1]:
        pool.release(slot)
    assert pool.give_back(10.0, keep=0, after=10) == 0, "all 20 were in use at once"
    assert pool.give_back(20.0, keep=0, after=10) == 0, "1 in use, but it is the top slot"
    pool.release(taken[-1])
    assert pool.give_back(30.0, keep=0, after=10) == 18, "then down to its first size"


@pytest.mark.parametrize(
    ("reach", "cap"),
    [(256, 128), (100, 50), (14, 7), (13, 6), (8, 6), (6, 5), (5, 4), (3, 2), (2, 2), (1, 2)],
)
def test_a_session_is_granted_at_most_its_share_of_the_pool(reach: int, cap: int) -> None:
    """NOTE [ Credits per session ]: half, or a trainer's default 6 where that is more, leaving the
    others one slot; at least 2."""
    assert credit_cap(reach) == cap


def test_the_share_a_session_always_gets_is_a_trainers_default_credits() -> None:
    assert Hello("x", 1).credits == SHARE_LEAST
    assert inspect.signature(ServiceLoader).parameters["credits"].default == SHARE_LEAST


@pytest.mark.parametrize(
    ("size", "floor"),
    [(16 * MIB, 4 * MIB), (64 * MIB, 16 * MIB), (300 * MIB, 64 * MIB), (1024 * MIB, 1024 * MIB // 10)],
)
def test_the_dev_shm_floor_is_a_tenth_or_a_quarter_up_to_64_mib(size: int, floor: int) -> None:
    assert shm_floor(size) == floor


def test_what_a_trainer_here_was_handed_is_kept_until_it_leaves() -> None:
    """NOTE [ Giving slots back ]: a trainer that maps the pool may have pinned every slot up to the
    highest it was handed; a remote one maps nothing."""
    attached = Attachments()
    local = Session(b"a", "t1", Hello("local", 1), 0, 0.0)
    remote = Session(b"b", "t2", Hello("remote", 2), 0, 0.0, remote=True)
    other_feed = Session(b"c", "t3", Hello("other", 3), 1, 0.0)
    for session in (local, remote, other_feed):
        attached.add(session)
    for slot in (3, 9, 4):
        local.note_announced(slot)
    remote.note_announced(40)
    other_feed.note_announced(60)
    assert (local.pinned_through, remote.pinned_through) == (10, 0)
    assert attached.pinned_through(0) == 10 and attached.pinned_through(1) == 61
    attached.forget(local)
    assert attached.pinned_through(0) == 0, "gone with its session"
