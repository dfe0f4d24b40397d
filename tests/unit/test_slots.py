from __future__ import annotations

import pytest

from loader_service.supervisor.slots import SlotPool, SlotState, SlotStateError


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
