"""A job's weight changes as the trainer keeps them (NOTE [ Weight changes ]) and as the service
takes them into its mixture (NOTE [ Weightings ]): checked, in order, in the checkpoint."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpu_worker.weighting import STATE_KEY, WeightChanges
from loader_service.dataset.mixture import Mixture, integer_weights
from loader_service.dataset.tables import DatasetError
from loader_service.supervisor.streams.choosing import Choice, Chooser
from loader_service.supervisor.streams.producers import Producer
from protocol.messages import MAX_WEIGHT_CHANGES
from protocol.weights import MAX_EPOCH_SAMPLES, ordered_weights

NAMES = ("a", "b", "c")


def test_weights_are_put_in_the_sources_order() -> None:
    assert ordered_weights({"c": 3, "a": 1, "b": 2.5}, NAMES) == (1.0, 2.5, 3.0)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1, "b": 1}, "missing c"),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "unknown d"),
        ({"a": 1, "b": -1, "c": 1}, "weight of 'b' must be a finite number"),
        ({"a": 1, "b": float("nan"), "c": 1}, "weight of 'b' must be a finite number"),
        ({"a": True, "b": 1, "c": 1}, "weight of 'a' must be a finite number"),
        ({"a": 0, "b": 0, "c": 0}, "all zero"),
    ],
)
def test_bad_weights_are_refused_by_name(weights: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ordered_weights(weights, NAMES)


def test_changes_are_never_in_the_past_and_the_same_one_again_is_no_change() -> None:
    changes = WeightChanges().then(100, (1.0, 0.0, 1.0), next_sample=40)
    assert changes.then(100, (1.0, 0.0, 1.0), next_sample=160) is changes, "given again, once past"
    with pytest.raises(ValueError, match="already past"):
        changes.then(120, (1.0, 1.0, 1.0), next_sample=160)
    with pytest.raises(ValueError, match="before the last one, at 100"):
        changes.then(90, (1.0, 1.0, 1.0), next_sample=40)
    replaced = changes.then(100, (2.0, 1.0, 1.0), next_sample=40)
    assert replaced.changes == ((100, (2.0, 1.0, 1.0)),)


def test_a_job_may_change_its_weights_a_bounded_number_of_times() -> None:
    changes = WeightChanges()
    for n in range(MAX_WEIGHT_CHANGES):
        changes = changes.then(n, (1.0, 1.0, float(n)), next_sample=0)
    with pytest.raises(ValueError, match=f"at most {MAX_WEIGHT_CHANGES} times"):
        changes.then(MAX_WEIGHT_CHANGES, (1.0, 1.0, 1.0), next_sample=0)


def test_the_changes_go_through_a_checkpoint_and_back() -> None:
    changes = WeightChanges().then(96, (0.7, 0.0, 0.3), 0).then(400, (1.0, 1.0, 1.0), 0)
    state = json.loads(json.dumps(changes.state()))
    assert WeightChanges.from_state(state, 3) == changes
    assert WeightChanges().state() == {}, "a state without changes stays as it was"
    assert WeightChanges.from_state({}, 3) == WeightChanges()


@pytest.mark.parametrize(
    "saved",
    [
        "not a list",
        [[96, [1.0, 1.0]]],  # two weights for three sources
        [[96, [1.0, 1.0, 1.0]], [40, [1.0, 1.0, 1.0]]],  # out of order
        [[96.0, [1.0, 1.0, 1.0]]],
        [[96, [0.0, 0.0, 0.0]]],
        [[96, [1.0, 1.0, 1.0]]] * (MAX_WEIGHT_CHANGES + 1),
    ],
)
def test_a_state_with_bad_changes_is_refused(saved: object) -> None:
    with pytest.raises(ValueError, match=r"weight|zero"):
        WeightChanges.from_state({STATE_KEY: saved}, 3)


def mixture(epoch_samples: int = 1000) -> Mixture:
    return Mixture.of((50, 30, 20), 7, epoch_samples, integer_weights({"a": 1, "b": 1, "c": 1}, NAMES))


def test_the_service_takes_changes_over_the_jobs_first_weights() -> None:
    base = mixture()
    changed = base.changed([(1500, (1.0, 0.0, 0.0))], NAMES)
    assert changed.weights == base.weights, "the fingerprint's weights stay the hello's"
    assert changed.weighting.changes[1] == (1500, integer_weights({"a": 1, "b": 0, "c": 0}, NAMES))
    assert changed.changed([], NAMES) == base, "a start without changes: the first weights again"
    at_zero = base.changed([(0, (0.0, 1.0, 0.0))], NAMES)
    assert at_zero.weights == base.weights and at_zero.epoch(0).sources(np.arange(5)).tolist() == [1] * 5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ([(10, (1.0, 1.0))], "gives 2 weights for 3 sources"),
        ([(10, (1.0, -1.0, 1.0))], "must be a finite number"),
        ([(50, (1.0, 1.0, 1.0)), (10, (1.0, 1.0, 1.0))], "before the last one"),
    ],
)
def test_changes_the_service_cannot_take_are_refused_by_name(
    changes: list[tuple[int, tuple[float, ...]]], message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        mixture().changed(changes, NAMES)


def test_a_schedule_that_would_cost_too_much_choosing_is_refused() -> None:
    big = mixture(MAX_EPOCH_SAMPLES)
    many = [(e * MAX_EPOCH_SAMPLES, (1.0, 1.0, float(e))) for e in range(1, 4)]
    with pytest.raises(DatasetError, match="choose a smaller epoch_samples, or fewer changes"):
        big.changed(many, NAMES)


def test_an_epoch_is_chosen_on_the_chooser_thread_not_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Choosing off the main loop ]: asking returns at once, the choosing runs on the one
    chooser thread, and the result is the epoch the caller would have chosen itself."""
    threads: list[str] = []
    choose = Mixture.choose

    def recording(self: Mixture, epoch: int, going: Any = lambda: True) -> Any:
        threads.append(threading.current_thread().name)
        return choose(self, epoch, going)

    monkeypatch.setattr(Mixture, "choose", recording)
    big = Mixture.of(
        (5_000_000, 3_000_000, 2_000_000), 3, 10_000_000, integer_weights({"a": 5, "b": 3, "c": 2}, NAMES)
    )
    asked = time.monotonic()
    choice = Choice(big, 1, on=Chooser())
    assert time.monotonic() - asked < 0.05, "asking does not choose"
    assert choice.wait(60)
    assert threads == ["mixture-order"]
    positions = np.arange(0, 10_000_000, 999_983)
    assert choice.result().at(positions).tolist() == big.epoch(1).at(positions).tolist()
    assert choice.of(big, 1) and not choice.of(big, 2)


def test_a_choice_handed_over_survives_the_producer_that_asked_moving_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream takes the epoch chosen for the batches decoded ahead; the ahead producer then
    moves to the next epoch, which cancels its own requests, never the one it handed over (two
    weighted jobs once crashed the service so: a cancelled request read as chosen)."""
    mixture = Mixture.of((50, 30, 20), 7, 100, integer_weights({"a": 1, "b": 1, "c": 1}, NAMES))
    blocker = Mixture.of((50, 30, 20), 7, 101, integer_weights({"a": 1, "b": 1, "c": 1}, NAMES))
    busy = threading.Event()
    choose = Mixture.choose

    def held(self: Mixture, epoch: int, going: Any = lambda: True) -> Any:
        if self == blocker:
            busy.wait(30)
        return choose(self, epoch, going)

    monkeypatch.setattr(Mixture, "choose", held)
    feed: Any = None  # neither producer plans a batch here
    ahead, stream = Producer(feed, (1, 0, 1, "pad", 0)), Producer(feed, (1, 0, 1, "pad", 0))
    ahead.mixture = stream.mixture = mixture
    occupied = Choice(blocker, 0)  # the one chooser thread is busy: the request waits, cancellable
    try:
        ahead.order_ready()
        stream.share_choice(ahead)
        ahead.restart((2, 0, 1, "pad", 0))
        assert stream._choice is not None and not stream._choice.cancelled()
    finally:
        busy.set()
    assert stream._choice.wait(30)
    assert stream.chosen is not None and stream.chosen.number == 1
    occupied.cancel()
