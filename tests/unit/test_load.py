"""NOTE [ Fleet load ]: the load a scaler reads, from workers' time on tasks and trainers' waits."""

from __future__ import annotations

import math

import pytest

from loader_service.supervisor.load import MAX_DEMAND, WINDOW, Totals, WorkerTime, busy, demand, measure


def loop_of(*samples: tuple[float, float, float]) -> Totals:
    loop = Totals()
    for now, waited, computed in samples:
        loop.add(now, waited, computed)
    return loop


def test_a_trainer_that_waits_half_its_time_asks_for_twice_the_data() -> None:
    assert demand(loop_of((0, 0, 0), (4, 2, 2))) == 2.0
    assert demand(loop_of((0, 0, 0), (4, 0, 4))) == 1.0, "one that never waits asks for what it gets"
    assert demand(loop_of((0, 0, 0), (4, 4, 0))) == MAX_DEMAND, "one that only waits, bounded"
    assert demand(loop_of((0, 5, 5))) == 1.0, "nothing to tell from one heartbeat"


def test_demand_is_measured_over_the_last_window_only() -> None:
    # waited the whole first minute, then computed without waiting for more than a window
    samples = [(0.0, 0.0, 0.0), (60.0, 60.0, 0.0)]
    samples += [(60.0 + t, 60.0, float(t)) for t in range(1, int(WINDOW) * 3)]
    assert demand(loop_of(*samples)) == 1.0


def test_totals_that_go_backwards_start_the_window_again() -> None:
    """A loader that restarted (or a peer that lies) reports smaller totals: never a negative wait."""
    loop = loop_of((0, 50, 50), (2, 60, 52), (3, 1, 1), (5, 1, 3))
    assert demand(loop) == 1.0


def test_samples_kept_are_bounded_whatever_a_peer_sends() -> None:
    loop = loop_of(*[(i * 0.001, float(i), float(i)) for i in range(10_000)])
    assert len(loop._samples) <= 64


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
    assert measure(workers, []).status() == {"load": 0.0, "busy": 0.0, "demand": 1.0}
