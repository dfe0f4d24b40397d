"""NOTE [ Remote sends ]: copies on their way to remote trainers, bounded per session and in all."""

from __future__ import annotations

from loader_service.supervisor.trainers.sends import SendBudget


class SendStub:
    """A ZeroMQ send in progress, finished by the test."""

    def __init__(self) -> None:
        self.done = False


def test_a_session_never_has_more_copies_on_their_way_than_its_credits() -> None:
    budget = SendBudget(limit=1000)
    sends = [SendStub(), SendStub()]
    for send in sends:
        assert budget.room("t1", 10, credits=2)
        budget.add("t1", send, 10)
    assert not budget.room("t1", 10, credits=2)
    assert budget.room("t2", 10, credits=2), "another session is not held up by it"
    sends[0].done = True
    assert budget.room("t1", 10, credits=2) and budget.held == 10


def test_all_sessions_together_stay_within_the_limit() -> None:
    budget = SendBudget(limit=100)
    first = SendStub()
    budget.add("t1", first, 80)
    assert not budget.room("t2", 30, credits=6)
    assert budget.room("t2", 20, credits=6)
    first.done = True
    assert budget.room("t2", 100, credits=6) and budget.held == 0


def test_one_batch_larger_than_the_limit_still_goes_alone() -> None:
    budget = SendBudget(limit=10)
    assert budget.room("t1", 50, credits=6)


def test_the_oldest_unfinished_copy_says_since_when_a_session_stopped_reading() -> None:
    budget = SendBudget(limit=1000)
    assert budget.stuck_since("t1") is None
    first, second = SendStub(), SendStub()
    budget.add("t1", first, 1)
    since = budget.stuck_since("t1")
    budget.add("t1", second, 1)
    assert budget.stuck_since("t1") == since
    first.done = second.done = True
    budget.settle()
    assert budget.stuck_since("t1") is None
