"""The process the decode workers are forked from (NOTE [ Workers from a template ]), with real
processes: stopped (SIGSTOP) while a worker dies, it costs a replacement of the template and its
workers, never the main loop (NOTE [ A template that does not answer ]); and it ends with its
service."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.shm import remove_stale
from loader_service.supervisor.service import STOP_GRACE
from tests.helpers import (
    ServiceFactory,
    ServiceProcess,
    busy_worker,
    in_background,
    running,
    status,
    template_of,
    wait_until,
)

pytestmark = pytest.mark.integration
STATUS_BOUND = 3.0
"""Seconds a status may take while the template is stopped: the main loop answers in milliseconds;
one that waits on the template does not answer at all."""


def timed_status(endpoint: str) -> dict[str, Any]:
    started = time.monotonic()
    body = status(endpoint)
    took = time.monotonic() - started
    assert took < STATUS_BOUND, f"status took {took:.1f} s: the main loop was blocked"
    return body


def test_a_stopped_template_is_replaced_and_never_blocks_the_loop(
    photos: Path, start_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP the template, SIGKILL a busy worker: the worker's exit is the template's to report
    and its replacement the template's to fork. Status answers throughout, the trainer keeps its
    session and gets every sample of every epoch once, and the template that did not answer is
    killed and replaced, with every worker it had forked: the pool is back to its size."""
    caplog.set_level(logging.WARNING, logger="gpu_worker")
    n = len(build_index(photos))
    service = start_service(photos, workers=2, batch_size=4, task_timeout=3)
    enough = threading.Event()

    def trainer() -> list[list[int]]:
        epochs: list[list[int]] = []
        with ServiceLoader(service.endpoint, timeout=60) as loader:
            while not enough.is_set() or not epochs:
                epochs.append(sorted(i for batch in loader for i in batch.indices.tolist()))
        return epochs

    with in_background(trainer, "the trainer") as outcome:
        try:
            template, session, sessions = stop_the_template_and_kill_a_worker(service)
        finally:
            enough.set()
        epochs = outcome.result(120)
    assert all(epoch == list(range(n)) for epoch in epochs), "every sample of every epoch exactly once"
    assert sessions == {session}, "the trainer kept its session"
    assert not [r.message for r in caplog.records if "lost the loader service" in r.message]
    service.wait_for(rf"workers' template \(pid {template}\) did not answer")
    assert not running(template), "the template that did not answer was killed"
    assert template_of(service) != template
    assert "resumed on a new connection" not in service.log


def stop_the_template_and_kill_a_worker(service: ServiceProcess) -> tuple[int, str, set[str]]:
    """With a trainer attached: SIGSTOP the template, SIGKILL a busy worker, and ask status until
    the pool is back (each answer within ``STATUS_BOUND``); the template, the trainer's session
    before, and the sessions status listed meanwhile. The template is sent SIGCONT at the end,
    should it still be there."""
    endpoint = service.endpoint
    wait_until(lambda: status(endpoint)["attached"] == 1 and pool_back(status(endpoint)), "workers ready")
    before = timed_status(endpoint)
    forked = {w["pid"] for w in before["worker_list"]}
    template = template_of(service)
    os.kill(template, signal.SIGSTOP)
    sessions: set[str] = set()
    try:
        os.kill(a_busy_worker(endpoint), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            body = timed_status(endpoint)
            sessions |= {s["session"] for s in body["sessions"]}
            replaced = not {w["pid"] for w in body["worker_list"]} & forked
            if pool_back(body) and replaced and body["template_restarts"] == 1:
                return template, before["sessions"][0]["session"], sessions
            assert time.monotonic() < deadline, f"the pool never came back: {body}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(template, signal.SIGCONT)


def a_busy_worker(endpoint: str, timeout: float = 30) -> int:
    """The pid of a worker holding a task, as one status saw it. Asked once, not twice: a second
    look may find none busy, and ``os.kill(0, ...)`` would kill this test's whole process group
    (pytest and its runner with it: two whole-suite runs ended so, at 97 %, without a summary)."""
    deadline = time.monotonic() + timeout
    while (pid := busy_worker(endpoint)) is None:
        assert time.monotonic() < deadline, "no worker held a task"
        time.sleep(0.05)
    assert pid > 0, pid
    return pid


def pool_back(body: dict[str, Any]) -> bool:
    """Both workers started and ready."""
    return len(body["worker_list"]) == 2 and all(w["ready"] for w in body["worker_list"])


def test_the_template_and_its_workers_end_with_their_service(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Liveness the other way: the template and the workers forked from it watch the service, and
    a service killed outright (SIGKILL, no shutdown) leaves none of them running."""
    service = start_service(photos, workers=2)
    wait_until(lambda: pool_back(status(service.endpoint)), "workers ready")
    workers = [int(w["pid"]) for w in status(service.endpoint)["worker_list"]]
    template = template_of(service)
    os.kill(service.proc.pid, signal.SIGKILL)
    service.proc.wait(10)
    try:
        wait_until(lambda: not running(template) and not any(map(running, workers)), "all of them gone")
    finally:
        remove_stale()  # what the killed service left, as the next service to start removes it


def test_a_service_whose_template_is_stopped_still_stops(photos: Path, start_service: ServiceFactory) -> None:
    """NOTE [ Shutdown order ] with a template that does not answer: the workers stop, their exits
    unreported; the template is killed rather than waited on, and the service exits 0 within its
    grace and a little more."""
    service = start_service(photos, workers=2)
    wait_until(lambda: pool_back(status(service.endpoint)), "workers ready")
    template = template_of(service)
    os.kill(template, signal.SIGSTOP)
    try:
        assert service.stop(timeout=STOP_GRACE + 10) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(template, signal.SIGCONT)
    assert re.search(rf"workers' template \(pid {template}\) did not answer: .* at shutdown", service.log)
    assert not running(template)
