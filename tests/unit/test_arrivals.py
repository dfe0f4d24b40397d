"""NOTE [ Acknowledged delivery ]: announcements handed on in lease order, each once, gaps found."""

from __future__ import annotations

import pytest

from gpu_worker.arrivals import Arrivals
from protocol.messages import BatchReady, EpochEnd, Message


def batch(lease: int, seq: int | None = None) -> BatchReady:
    return BatchReady(1, 0, lease - 1 if seq is None else seq, lease, 0, 4)


def leases(out: list[tuple[Message, str | None]]) -> list[object]:
    return [m.lease if isinstance(m, BatchReady) else m.KIND for m, _ in out]


def test_in_order_announcements_pass_straight_through() -> None:
    a: Arrivals[str] = Arrivals(4)
    assert leases(a.batch(batch(1), "p1")) == [1]
    assert leases(a.batch(batch(2), "p2")) == [2]
    assert a.have == 2 and not a.ack_due and a.missing() == ()


def test_what_follows_a_gap_waits_for_it_and_the_gap_is_asked_for() -> None:
    a: Arrivals[str] = Arrivals(8)
    a.batch(batch(1), "p1")
    assert a.batch(batch(4), "p4") == []
    assert a.other(EpochEnd(1, 0, 4)) == []  # the end too waits behind the gap
    assert a.ack_due and a.missing() == (2, 3)
    assert leases(a.batch(batch(3), "p3")) == []
    assert a.missing() == (2,)
    out = a.batch(batch(2), "p2")
    assert leases(out) == [2, 3, 4, "end"]
    assert [p for _, p in out] == ["p2", "p3", "p4", None]
    assert a.have == 4 and a.missing() == ()


def test_an_announcement_that_arrives_twice_is_passed_on_once() -> None:
    a: Arrivals[str] = Arrivals(8)
    a.batch(batch(1), "p1")
    a.batch(batch(3), "p3")
    assert a.batch(batch(1), "again") == []
    assert a.batch(batch(3), "again") == []
    assert [p for _, p in a.batch(batch(2), "p2")] == ["p2", "p3"]


def test_a_heartbeat_shows_announcements_lost_after_the_last_one_received() -> None:
    """Every credit was announced and lost: only the heartbeat tells."""
    a: Arrivals[str] = Arrivals(8)
    a.batch(batch(1), "p1")
    a.heartbeat(sent=5)
    assert a.ack_due and a.missing() == (2, 3, 4, 5)


def test_more_announcements_out_than_credits_granted_is_refused() -> None:
    a: Arrivals[str] = Arrivals(4)
    with pytest.raises(OverflowError, match="more than the 4 credits"):
        a.batch(batch(6), "p")
    with pytest.raises(OverflowError):
        a.heartbeat(sent=2**40)


def test_a_new_session_forgets_what_waited_and_returns_its_payloads() -> None:
    a: Arrivals[str] = Arrivals(8)
    a.batch(batch(2), "p2")
    assert a.dropped_payloads() == ["p2"]
    assert a.batch(batch(1), "p1") and a.have == 1


def test_an_end_waits_for_announcements_lost_at_the_tail() -> None:
    """Nothing arrived after the lost ones, but a heartbeat said they were sent: the end waits."""
    a: Arrivals[str] = Arrivals(8)
    a.batch(batch(1), "p1")
    a.heartbeat(sent=3)
    assert a.other(EpochEnd(1, 0, 3)) == []
    assert leases(a.batch(batch(2), "p2")) == [2]
    assert leases(a.batch(batch(3), "p3")) == [3, "end"]
