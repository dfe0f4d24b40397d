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


class SendStub:
    """A ZeroMQ send in progress, finished by the test."""

    def __init__(self) -> None:
        self.done = False


def test_a_slot_still_being_sent_is_not_reused_until_the_send_is_done() -> None:
    pool = SlotPool(1)
    slot = pool.acquire()
    assert slot is not None
    pool.filled(slot)
    pool.lease(slot)
    first, second = SendStub(), SendStub()
    pool.track(slot, first)
    pool.track(slot, second)  # a broadcast group with two remote members
    pool.release(slot)
    assert pool.state(slot) is SlotState.FREE
    assert pool.free == 0 and pool.acquire() is None, "ZeroMQ may still read it"
    assert pool.sending == 1
    first.done = True
    assert pool.acquire() is None, "one send is still reading it"
    second.done = True
    assert pool.free == 1 and pool.sending == 0 and pool.acquire() == slot


def test_a_send_done_before_the_release_does_not_hold_the_slot() -> None:
    pool = SlotPool(1)
    slot = pool.acquire()
    assert slot is not None
    sent = SendStub()
    pool.track(slot, sent)
    sent.done = True
    pool.release(slot)
    assert pool.acquire() == slot
