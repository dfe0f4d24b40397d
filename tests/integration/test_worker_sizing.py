"""``--workers auto`` with real processes (NOTE [ Sizing workers ], NOTE [ CPU budget ]): the count
the controller reaches for a feed that waits and one that computes, its retreat when the trainer
stops waiting, the budget under a real affinity mask and a real cgroup quota, and workers killed
while parked or active."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceLoader
from loader_service.tools.status_view import query_status
from tests.helpers import ServiceFactory, ServiceProcess, running, template_of

pytestmark = pytest.mark.integration
CPUS = len(os.sched_getaffinity(0))
WAITING_PIPELINE = """
import time

import numpy as np


def make(sample, rng):
    # A second read, a remote lookup: the worker waits, it does not compute. 30 ms, so that 8 such
    # workers (270 images/s) stay under what this 2-core host's main loop and trainer can carry
    # (measured: about 450 images/s of these batches), where the addition's gain is not linear.
    time.sleep(0.03)
    return {"image": np.zeros((3, 8, 8), np.uint8), "label": np.int64(sample["label"])}
"""


def sizing(service: ServiceProcess) -> dict[str, Any]:
    body = query_status(service.endpoint, 10)
    assert isinstance(body["sizing"], dict)
    return body["sizing"]


def train(loader: ServiceLoader, seconds: float, step: float = 0.0) -> list[int]:
    """Pull batches for ``seconds``, each step taking ``step``; the indices of the epochs finished."""
    end, seen = time.monotonic() + seconds, []
    while time.monotonic() < end:
        epoch = []
        for batch in loader:
            epoch += batch.indices.tolist()
            if step:
                time.sleep(step)  # the trainer's own step: it computes, it does not wait
        seen.append(sorted(epoch))
    return [i for epoch in seen for i in epoch]


def train_until(loader: ServiceLoader, done: Callable[[], bool], deadline: float, step: float = 0.0) -> bool:
    """Pull batches (each step taking ``step``) until ``done()``, asked about twice a second, or
    ``deadline`` seconds: whether it came. A busy machine moves the moment, not the outcome."""
    end, asked = time.monotonic() + deadline, 0.0
    while time.monotonic() < end:
        for _batch in loader:
            if step:
                time.sleep(step)
            if time.monotonic() - asked >= 0.5:
                asked = time.monotonic()
                if done():
                    return True
            if time.monotonic() >= end:
                break
    return done()


def auto(start_service: ServiceFactory, photos: Path, **flags: object) -> ServiceProcess:
    return start_service(photos, workers="auto", heartbeat_interval=0.25, **{"batch_size": 4, **flags})


def test_a_feed_whose_workers_wait_gets_more_workers_than_cores(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    pipeline = tmp_path / "waiting.py"
    pipeline.write_text(textwrap.dedent(WAITING_PIPELINE))
    # 450 samples: 56 tasks an epoch keep 8 workers busy (90 would leave a round of 12 tasks a
    # third idle, and an addition's gain short of what it promised for that reason alone).
    data = tmp_path / "data"
    for copy in range(5):
        for photo in photos.rglob("*.jpg"):
            target = data / photo.parent.name / f"{copy}-{photo.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(photo)
    service = auto(start_service, data, pipeline=f"{pipeline}:make", batch_size=8)
    first = sizing(service)
    assert first["mode"] == "auto" and first["active"] == max(1, int(first["budget"]))
    attached = time.monotonic()
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        train(loader, 8.0)
        now, asked = sizing(service), time.monotonic()
    # The addition is the feature; whether it stays is the gain check's (rule 4, tests/unit), which
    # rightly undoes it where the host cannot carry the gain: a fresh-clone run's other tests on the
    # same two cores let it gain +98 of the 219 images/s it promised, and it was undone.
    added = [d for d in now["decisions"] if "trainers wait" in d["reason"]]
    assert added and added[0]["to"] > now["budget"] >= 1, f"more workers than cores: {now}"
    adds = [asked - d["seconds_ago"] - attached for d in added]
    # NOTE [ Early heartbeat ]: the first waiting heartbeat comes 0.25 s after the attach and the
    # first window ends 0.5 s after it (measured: 0.5 s, benchmarks.sizing); 2 s leaves a busy
    # machine its slack and still fails the 8 s a trainer once waited (tests/unit has the rule).
    assert adds and adds[0] < 2.0, f"the first addition came {adds[0] if adds else None} s after attaching"
    service.wait_for(r"decode workers \d+ -> \d+: trainers wait")


def test_a_feed_that_computes_stays_in_the_budget_and_backs_off_when_the_trainer_stops_waiting(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = auto(start_service, photos, image_size=128)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        # Long enough for an addition and its check (one more window) to be over before the
        # trainer changes its own step, which the check would take for the workers'.
        train(loader, 8.0)
        busy = sizing(service)
        assert busy["active"] <= max(1, round(busy["budget"])), f"a core per worker at most: {busy}"

        # Now the trainer is the bottleneck: fewer after SETTLE of calm (a minute allows for undos
        # and holds on a busy machine; 16 s of training were too few there).
        def calm() -> bool:
            return any("no trainer waits" in d["reason"] for d in sizing(service)["decisions"])

        assert train_until(loader, calm, 60.0, step=0.3), f"no removal within a minute: {sizing(service)}"
        idle = sizing(service)
    if CPUS < 2:
        pytest.skip("one CPU: one worker from the start, nothing to back off from")
    assert busy["active"] == int(busy["budget"]) >= 2, f"a worker per core while the trainer waits: {busy}"
    assert idle["active"] == 1, f"one once nobody waits: {idle}"
    assert any("no trainer waits" in d["reason"] for d in idle["decisions"]), idle
    step_ms = idle["window"]["step_ms"]
    assert 250 <= step_ms <= 450, f"the trainer's 300 ms step, from its heartbeats' pulls: {idle}"


@contextlib.contextmanager
def affinity(cpus: set[int]) -> Iterator[None]:
    """This process (and what it starts meanwhile) on ``cpus`` only."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def cpu_quota(cores: float) -> Iterator[None]:
    """This process (and what it starts meanwhile) in a new cgroup v1 with a CPU quota; moved back
    after, the cgroup removed once empty."""
    if not os.access(CGROUP_V1 / "cgroup.procs", os.W_OK):
        pytest.skip("no writable cgroup v1 cpu controller here")
    group = CGROUP_V1 / f"dataferry-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * 100000)))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (CGROUP_V1 / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        remove_when_empty(group)


def remove_when_empty(group: Path) -> None:
    for _ in range(100):  # the service's processes leave it as they exit
        with contextlib.suppress(OSError):
            group.rmdir()
            return
        time.sleep(0.05)


def test_the_budget_is_the_affinity_mask_the_service_runs_under(
    photos: Path, start_service: ServiceFactory
) -> None:
    with affinity({min(os.sched_getaffinity(0))}):
        service = auto(start_service, photos)
    line = service.wait_for(r"CPU budget ([\d.]+) cores \(([^)]*)").group(0)
    got = sizing(service)
    assert got["budget"] == 1.0 and got["active"] == 1 and got["most"] == 4, (line, got)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        train(loader, 5.0)
    assert sizing(service)["active"] == 1, "one core: one worker of a core, however long it waits"


def test_the_budget_is_the_cgroup_quota_the_service_runs_under(
    photos: Path, start_service: ServiceFactory
) -> None:
    with cpu_quota(1.5):
        service = auto(start_service, photos)
        service.wait_for(r"CPU budget 1\.50 cores \(cgroup v1")
        got = sizing(service)
        service.stop()
    assert got["budget"] == 1.5 and got["active"] == 1 and got["most"] == 6, got


def test_a_worker_or_the_template_killed_costs_nothing(photos: Path, start_service: ServiceFactory) -> None:
    """NOTE [ Workers from a template ]: a worker killed is replaced and its batch redone; a killed
    template takes what the service knows of its workers with it, so they are all ended and
    replaced from a new template, none left running beside its replacement."""
    service = auto(start_service, photos)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        seen: list[int] = []
        for i, batch in enumerate(loader):
            seen += batch.indices.tolist()
            if i == 2:
                workers = query_status(service.endpoint, 10)["worker_list"]
                template = template_of(service)
                os.kill(template, signal.SIGKILL)
                os.kill(workers[0]["pid"], signal.SIGKILL)  # taking tasks
        again = loader.stats()
        now = query_status(service.endpoint, 10)["worker_list"]
        assert template_of(service) != template
    assert not {w["pid"] for w in now} & {w["pid"] for w in workers}, "every worker replaced"
    assert not [w for w in workers if running(w["pid"])], "none left running"
    assert sorted(seen) == list(range(90)), "every image once"
    assert again["reassigned"] == 0
    service.wait_for(r"started decode worker 0 ", count=2)
