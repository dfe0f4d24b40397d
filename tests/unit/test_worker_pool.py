"""Worker supervision decisions, with stand-in processes for what cannot be made here.

A process in uninterruptible sleep, which SIGKILL cannot end until its kernel call returns, cannot
be produced on demand without root-only tricks; ``Unkillable`` stands in for one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any, cast

import pytest

from loader_service.decode.contract import WorkerConfig
from loader_service.shm import process_start
from loader_service.supervisor.workers.pool import WorkerSet

TEMPLATE = WorkerConfig(
    worker=0, parent_pid=1, parent_start="", backend="ipc://unused", feeds=(), log_level="INFO"
)


class Unkillable:
    """A process that ignores kill() until ``wake`` is called (as one stuck in D state would)."""

    next_pid = 1000

    def __init__(self) -> None:
        Unkillable.next_pid += 1
        self.pid = Unkillable.next_pid
        self.exitcode: int | None = None
        self.kills = 0
        self.closed = False

    def kill(self) -> None:
        self.kills += 1

    def wake(self) -> None:
        self.exitcode = -9

    def close(self) -> None:
        self.closed = True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


def pool_with_one_busy_worker() -> tuple[WorkerSet, list[Unkillable]]:
    spawned: list[Unkillable] = []

    def spawn(cfg: WorkerConfig) -> Any:
        spawned.append(Unkillable())
        return spawned[-1]

    workers = WorkerSet(TEMPLATE, 1, spawn=spawn)
    (handle,) = list(workers)
    workers.mark_ready(handle, b"w0")
    handle.task, handle.task_since = 7, 0.0
    return workers, spawned


def test_a_stuck_worker_is_killed_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    workers, spawned = pool_with_one_busy_worker()
    with caplog.at_level(logging.ERROR):
        for now in (11.0, 11.1, 11.2, 12.0):
            assert workers.check_stuck(now, limit=10.0, lost_after=5.0) == []
    assert spawned[0].kills == 1
    assert sum("killing it" in r.message for r in caplog.records) == 1


def test_a_worker_that_cannot_die_is_replaced_and_its_task_given_back_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    workers, spawned = pool_with_one_busy_worker()
    workers.check_stuck(11.0, limit=10.0, lost_after=5.0)
    with caplog.at_level(logging.ERROR):
        lost = workers.check_stuck(16.5, limit=10.0, lost_after=5.0)
        assert [h.task for h in lost] == [7], "its batch is redone elsewhere"
        assert workers.check_stuck(30.0, limit=10.0, lost_after=5.0) == [], "given up only once"
    assert sum("has not exited" in r.message for r in caplog.records) == 1
    workers.reap(16.5)
    assert len(spawned) == 2 and workers.restarts == 1, "a replacement started"
    assert [cast(Unkillable, h.process) for h in workers] == [spawned[1]]
    assert workers.lost == 1 and spawned[0].kills == 1, "the old pid is watched, not signalled again"
    spawned[0].wake()
    with caplog.at_level(logging.INFO):
        workers.reap(40.0)
    assert workers.lost == 0 and spawned[0].closed
    assert any("finally exited" in r.message for r in caplog.records)


def test_a_worker_knows_the_service_by_a_start_time_the_service_took_itself() -> None:
    """NOTE [ Workers from a template ]: a worker compares the service's start time now with the one
    the service put in its config; a service gone (even before the worker booted) reads as ""."""
    me = process_start(os.getpid())
    assert me and process_start(os.getpid()) == me
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    taken = process_start(gone.pid)
    gone.wait(10)
    assert taken and process_start(gone.pid) != taken, "a reaped process no longer answers to its start"
