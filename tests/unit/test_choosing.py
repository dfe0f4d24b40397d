"""The chooser's queues (NOTE [ Choosing off the main loop ]): a request nobody wants is gone before
it runs, requesters take turns, identical requests share one choice, a requester's queue is
bounded, and a stop waits for nothing queued."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from loader_service.dataset.mixture import Mixture, integer_weights
from loader_service.supervisor.streams.choosing import QUEUED_PER_REQUESTER, Choice, Chooser

NAMES = ("a", "b", "c")


LENGTHS = itertools.count(7_000)


def fresh() -> Mixture:
    """A mixture whose order nobody has chosen yet in this process (an epoch length of its own):
    orders chosen are kept (NOTE [ Epoch marks ]) and would be answered at once."""
    return Mixture.of((50, 30, 20), 7, next(LENGTHS), integer_weights({"a": 1, "b": 2, "c": 3}, NAMES))


class Gate:
    """Holds the chooser thread in each choice until let through, and records what it chose."""

    def __init__(self) -> None:
        self.chosen: list[int] = []
        self.entered = threading.Semaphore(0)
        self.through = threading.Semaphore(0)

    def let_one_through(self) -> int:
        """Wait for the thread to begin a choice, let it finish: that choice's epoch length."""
        assert self.entered.acquire(timeout=30), "the chooser began no choice"
        self.through.release()
        return self.chosen[-1]


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    choose = Mixture.choose

    def gated(self: Mixture, epoch: int, going: Any = lambda: True) -> Any:
        held.chosen.append(self.epoch_samples)
        held.entered.release()
        assert held.through.acquire(timeout=30)
        return choose(self, epoch, going)

    monkeypatch.setattr(Mixture, "choose", gated)
    yield held
    for _ in range(16):
        held.through.release()  # nothing is left held, whatever the test did


@pytest.fixture
def chooser() -> Iterator[Chooser]:
    """A chooser of the test's own, its thread stopped after it."""
    made = Chooser()
    yield made
    made.stop()


def test_a_cancelled_request_is_never_chosen(gate: Gate, chooser: Chooser) -> None:
    first, later, *left = (fresh() for _ in range(7))
    Choice(first, 0, "a", chooser)
    assert gate.entered.acquire(timeout=30)  # the thread is in the first choice
    gone = [Choice(m, 0, f"left{i}", chooser) for i, m in enumerate(left)]
    assert chooser.queued == 5
    for choice in gone:
        choice.cancel()
    assert chooser.queued == 0, "cancelling takes a request out of the queue"
    waiting = Choice(later, 0, "b", chooser)
    gate.through.release()
    assert gate.let_one_through() == later.epoch_samples, "the trainers that left cost nothing"
    assert waiting.wait(30)
    assert all(choice.cancelled() and not choice.done() for choice in gone)
    assert gate.chosen == [first.epoch_samples, later.epoch_samples]


def test_requesters_take_turns(gate: Gate, chooser: Chooser) -> None:
    busy, one, two, other = (fresh() for _ in range(4))
    Choice(busy, 0, "busy", chooser)
    assert gate.entered.acquire(timeout=30)
    burst = [Choice(one, 0, "burst", chooser), Choice(two, 0, "burst", chooser)]
    others = Choice(other, 0, "other", chooser)
    gate.through.release()
    turns = [gate.let_one_through() for _ in range(3)]
    assert turns == [one.epoch_samples, other.epoch_samples, two.epoch_samples], "one each, in turn"
    assert others.wait(30) and all(c.wait(30) for c in burst)


def test_a_requesters_queue_is_bounded_and_asked_again(gate: Gate, chooser: Chooser) -> None:
    busy, extra, *asked = (fresh() for _ in range(2 + QUEUED_PER_REQUESTER))
    Choice(busy, 0, "busy", chooser)
    assert gate.entered.acquire(timeout=30)
    kept = [Choice(m, 0, "r", chooser) for m in asked]
    refused = Choice(extra, 0, "r", chooser)
    assert refused.cancelled() and not refused.wait(0), "refused: its producer asks again later"
    assert chooser.queued == QUEUED_PER_REQUESTER
    gate.through.release()
    for _ in kept:
        gate.let_one_through()
    assert all(choice.wait(30) for choice in kept)
    again = Choice(extra, 0, "r", chooser)
    gate.let_one_through()
    assert again.wait(30)


def test_identical_requests_share_one_choice_and_a_held_order_is_answered_at_once(
    gate: Gate, chooser: Chooser
) -> None:
    shared = fresh()
    one, two = Choice(shared, 3, "a", chooser), Choice(shared, 3, "b", chooser)
    one.cancel()  # the other still wants it: it is chosen
    gate.let_one_through()
    assert two.wait(30) and two.result().number == 3
    held = Choice(shared, 4, "c", chooser)  # another epoch of the same weights: the same marks
    assert held.done() and held.result().number == 4
    assert gate.chosen == [shared.epoch_samples], "chosen once for all three"


def test_a_stop_waits_for_nothing_queued(gate: Gate, chooser: Chooser) -> None:
    first, late, *queued_for = (fresh() for _ in range(10))
    running = Choice(first, 0, "a", chooser)
    assert gate.entered.acquire(timeout=30)
    queued = [Choice(m, 0, f"r{i}", chooser) for i, m in enumerate(queued_for)]
    chooser.stop()
    assert all(choice.cancelled() for choice in queued), "dropped, not chosen"
    gate.through.release()
    assert not running.wait(30) and running.cancelled(), "the one being chosen stops at its next chunk"
    assert gate.chosen == [first.epoch_samples]
    assert Choice(late, 0, "late", chooser).cancelled(), "a stopped chooser takes nothing more"
