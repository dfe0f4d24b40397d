"""NOTE [ Fleet load ]: the load a scaler reads, from workers' time on tasks and trainers' waits,
each wait counted only as far as the service saw it."""

from __future__ import annotations

import math

import pytest

from loader_service.supervisor.trainers.load import (
    MAX_DEMAND,
    WINDOW,
    TrainerLoop,
    WorkerTime,
    busy,
    measure,
    step_seconds,
    weighted_demand,
)
from protocol.messages import Heartbeat
from protocol.status import LoadStatus


def loop_of(*samples: tuple[float, float, float], per_second: int = 10) -> TrainerLoop:
    """A trainer whose heartbeats at ``now`` say it waited and computed those seconds, that this
    service saw starved all along and announced ``per_second`` batches a second."""
    loop = TrainerLoop()
    loop.watch(samples[0][0] if samples else 0.0, True)
    for now, waited, computed in samples:
        hear(loop, now, waited, computed, announced=int(now * per_second))
    return loop


def hear(
    loop: TrainerLoop, now: float, waited: float, computed: float, pulls: int = 0, announced: int = 0
) -> None:
    beat = Heartbeat("t", waited=round(waited * 1000), computed=round(computed * 1000), pulls=pulls)
    loop.heard(now, beat, announced)


def test_a_trainer_that_waits_half_its_time_asks_for_twice_the_data() -> None:
    assert loop_of((0, 0, 0), (4, 2, 2)).demand() == 2.0
    assert loop_of((0, 0, 0), (4, 0, 4)).demand() == 1.0, "one that never waits asks for what it gets"
    assert loop_of((0, 0, 0), (4, 4, 0)).demand() == MAX_DEMAND, "one that only waits, bounded"
    assert loop_of((0, 5, 5)).demand() == 1.0, "nothing to tell from one heartbeat"


def test_demand_is_measured_over_the_last_window_only() -> None:
    # waited the whole first minute, then computed without waiting for more than a window
    samples = [(0.0, 0.0, 0.0), (60.0, 60.0, 0.0)]
    samples += [(60.0 + t, 60.0, float(t)) for t in range(1, int(WINDOW) * 3)]
    assert loop_of(*samples).demand() == 1.0


def test_totals_that_go_backwards_start_the_window_again() -> None:
    """A loader that restarted (or a peer that lies) reports smaller totals: never a negative wait."""
    assert loop_of((0, 50, 50), (2, 60, 52), (3, 1, 1), (5, 1, 3)).demand() == 1.0


def test_samples_kept_are_bounded_whatever_a_peer_sends() -> None:
    loop = loop_of(*[(i * 0.001, float(i), float(i)) for i in range(10_000)])
    assert len(loop.totals._samples) <= 64


# --- what a trainer says, against what the service saw (issue 35) --------------------------------


def test_a_claimed_wait_counts_only_while_the_service_saw_the_trainer_starved() -> None:
    """It claims it waited 8 of 10 s and computed 2; the service saw it in an epoch all along and
    starved (a credit free, its next batch not ready) for 1 s: it waited 1 s at most, and the
    other 9 it had its batches, so it computed (or did something else) for them."""
    loop = TrainerLoop()
    loop.watch(0.0, False)
    hear(loop, 0.0, 0, 0, announced=0)
    loop.watch(4.0, True)
    loop.watch(5.0, False)
    hear(loop, 10.0, 8, 2, announced=20)
    assert (loop.in_epoch, loop.starved) == pytest.approx((10.0, 1.0))
    assert loop.demand() == pytest.approx((1 + 9) / 9)
    never = TrainerLoop()
    never.watch(0.0, False)
    hear(never, 0.0, 0, 0)
    hear(never, 10.0, 1000, 0.001, announced=20)
    assert never.demand() == 1.0, "never starved: however long it says it waited"


def test_time_in_no_epoch_is_neither_wait_nor_compute() -> None:
    """Between epochs (an evaluation) the loop counts neither, and nor does the service."""
    loop = TrainerLoop()
    loop.watch(0.0, None)
    hear(loop, 0.0, 0, 0)
    loop.watch(5.0, True)
    loop.watch(7.5, False)
    hear(loop, 10.0, 2.5, 2.5, announced=10)
    assert (loop.in_epoch, loop.starved) == pytest.approx((5.0, 2.5))
    assert loop.demand() == pytest.approx(2.0)


def test_a_trainer_that_took_no_batch_here_has_no_demand() -> None:
    loop = TrainerLoop()
    loop.watch(0.0, True)
    hear(loop, 0.0, 0, 0, announced=2)
    hear(loop, 10.0, 1000, 0.001, pulls=0, announced=2)  # its two batches, held since
    assert loop.demand() == 1.0 and loop.seen() is None
    assert weighted_demand([loop]) == 1.0


def test_a_trainer_that_holds_its_first_batches_counts_only_its_first_wait() -> None:
    """The real-process liar's figures: starved until its two batches came (0.3 s), then holding
    them for the rest of the window, claiming 100 s of wait and 1 ms of compute a second."""
    loop = TrainerLoop()
    loop.watch(0.0, True)
    hear(loop, 0.0, 0, 0)
    loop.watch(0.3, False)
    hear(loop, 5.0, 500, 0.005, announced=2)
    assert loop.demand() == pytest.approx((0.3 + 4.7) / 4.7)


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5])
def test_one_trainer_moves_the_services_demand_by_its_share_at_most(share: float) -> None:
    """An honest trainer that never waits beside one that claims it always does and was seen
    starved all along (the worst it can do): the service's demand moves by the liar's share of
    the batches announced here, no more."""
    honest = loop_of((0, 0, 0), (10, 0, 10), per_second=round(100 * (1 - share)))
    liar = loop_of((0, 0, 0), (10, 1000, 0), per_second=round(100 * share))
    assert honest.demand() == 1.0
    got = weighted_demand([honest, liar])
    assert got == pytest.approx(1 + share * (MAX_DEMAND - 1))
    assert got <= 1 + share * (MAX_DEMAND - 1) + 1e-9


def fed(step: float, batches: int) -> TrainerLoop:
    """A trainer that pulled ``batches`` over 10 s here, each step taking ``step`` by its word."""
    loop = TrainerLoop()
    loop.watch(0.0, False)
    hear(loop, 0.0, 0, 0)
    hear(loop, 10.0, 0, step * batches, pulls=batches, announced=batches)
    return loop


def test_the_step_is_of_the_trainers_that_took_batches_here() -> None:
    """The slower-step rule (NOTE [ Sizing workers ]) reads the compute per batch of the trainers
    this service feeds; one that took nothing here (or claims compute and pulls nothing) has no say."""
    idle = TrainerLoop()
    idle.watch(0.0, False)
    hear(idle, 0.0, 0, 0)
    hear(idle, 10.0, 0, 10, pulls=1)
    assert step_seconds([fed(0.05, 100), idle], 0.0) == pytest.approx(0.05)
    assert step_seconds([idle], 0.0) is None


def test_a_trainer_that_took_fewer_than_half_the_batches_cannot_move_the_step() -> None:
    """Its word is all the service has of its step, so the step is the median of theirs by the
    batches each took: one that claims a 10 s step moves it only by taking most of the batches."""
    assert step_seconds([fed(0.05, 100), fed(10.0, 2)], 0.0) == pytest.approx(0.05)
    assert step_seconds([fed(0.05, 100), fed(0.05, 50), fed(10.0, 140)], 0.0) == pytest.approx(0.05)
    assert step_seconds([fed(0.05, 10), fed(0.2, 90)], 0.0) == pytest.approx(0.2), "most of them: theirs"


# --- the workers --------------------------------------------------------------------------------


def test_busy_is_time_on_tasks_over_time_of_workers_there_were() -> None:
    workers = WorkerTime()
    workers.sample(0.0, 0.0, 4)
    workers.sample(2.0, 6.0, 4)  # 8 worker-seconds, 6 of them on tasks
    assert busy(workers.totals) == pytest.approx(0.75)
    workers.sample(4.0, 14.0, 4)  # now every worker always busy: 14 of 16
    assert busy(workers.totals) == pytest.approx(14 / 16)


@pytest.mark.parametrize(
    ("on_tasks", "waited", "computed", "expected"),
    [
        (10.0, 5.0, 5.0, 2.0),  # saturated, the trainer waits half its time: twice the services
        (10.0, 0.0, 10.0, 1.0),  # saturated and nobody waits: as many as now
        (5.0, 0.0, 10.0, 0.5),  # half idle and nobody waits: half would do
        (2.5, 0.0, 10.0, 0.25),
    ],
)
def test_load_is_the_capacity_asked_for_in_multiples_of_this_one(
    on_tasks: float, waited: float, computed: float, expected: float
) -> None:
    workers = WorkerTime()
    workers.sample(0.0, 0.0, 1)
    workers.sample(10.0, on_tasks, 1)
    trainer = loop_of((0.0, 0.0, 0.0), (10.0, waited, computed))
    load = measure(workers, [trainer, loop_of()])
    assert math.isclose(load.load, expected)


def test_without_trainers_the_load_is_what_the_workers_do() -> None:
    workers = WorkerTime()
    workers.sample(0.0, 0.0, 2)
    workers.sample(1.0, 0.0, 2)
    assert measure(workers, []).status() == LoadStatus(load=0.0, busy=0.0, demand=1.0)
