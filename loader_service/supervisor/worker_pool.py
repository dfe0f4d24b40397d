"""Spawning, watching and replacing decode worker processes.

The service's main loop asks this module three things each turn: which workers are idle, which have
died (their tasks must be redone), and to start replacements. Workers are ``spawn``ed with one frozen
``WorkerConfig`` each; a worker is idle once it has said ``w_ready`` and holds no task.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from loader_service.decode.worker import WORKER_BOOT_ERROR, WorkerConfig, run_worker
from loader_service.supervisor.rates import RateMeter

log = logging.getLogger(__name__)
_SPAWN = multiprocessing.get_context("spawn")
BOOT_BACKOFF = 0.25
MAX_BOOT_FAILURES = 5


@dataclass
class WorkerHandle:
    worker: int
    process: multiprocessing.process.BaseProcess
    routing_id: bytes | None = None
    task: int | None = None
    """The task id this worker is decoding, if any."""
    task_since: float = 0.0
    decoded: RateMeter = field(default_factory=RateMeter)

    @property
    def idle(self) -> bool:
        return self.routing_id is not None and self.task is None


class WorkerSet:
    """NOTE [ Worker restarts ]
    A worker that dies after it has said ``w_ready`` (SIGKILL, OOM, a crash inside OpenCV) is
    replaced at once and its task is redone. A worker that dies before ``w_ready``, or exits with
    ``WORKER_BOOT_ERROR``, failed to start: it is restarted after a doubling delay, and after
    ``MAX_BOOT_FAILURES`` such failures in a row ``given_up`` turns true and the service stops with
    a fatal error instead of restarting forever.
    """

    def __init__(self, template: WorkerConfig, count: int) -> None:
        self._template = template
        self._handles = {i: self._spawn(i) for i in range(count)}
        self._restart_at: dict[int, float] = {}
        self.restarts = 0
        self.boot_failures = 0

    @property
    def given_up(self) -> bool:
        return self.boot_failures >= MAX_BOOT_FAILURES

    def _spawn(self, worker: int) -> WorkerHandle:
        cfg = replace(self._template, worker=worker)
        process = _SPAWN.Process(
            target=run_worker, args=(cfg,), name=f"dataferry-worker-{worker}", daemon=True
        )
        process.start()
        log.info("started decode worker %d (pid %s)", worker, process.pid)
        return WorkerHandle(worker, process)

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self._handles.values())

    def get(self, worker: int) -> WorkerHandle | None:
        return self._handles.get(worker)

    def idle(self) -> list[WorkerHandle]:
        return [h for h in self._handles.values() if h.idle]

    def kill_stuck(self, now: float, limit: float) -> list[WorkerHandle]:
        """SIGKILL workers whose task has run for more than ``limit`` seconds (a hung read, a decoder
        that never returns); ``reap`` then replaces them and their task is redone."""
        stuck = [h for h in self._handles.values() if h.task is not None and now - h.task_since > limit]
        for h in stuck:
            log.error(
                "decode worker %d (pid %s) spent over %.0f s on task %s; killing it",
                h.worker,
                h.process.pid,
                limit,
                h.task,
            )
            h.process.kill()
        return stuck

    def mark_ready(self, handle: WorkerHandle, routing_id: bytes) -> None:
        handle.routing_id = routing_id
        self.boot_failures = 0

    def reap(self, now: float) -> list[WorkerHandle]:
        """Collect workers that exited and start the replacements that are due; return the dead."""
        dead = [h for h in self._handles.values() if h.process.exitcode is not None]
        for h in dead:
            del self._handles[h.worker]
            booted = h.routing_id is not None and h.process.exitcode != WORKER_BOOT_ERROR
            log.error(
                "decode worker %d (pid %s) %s with exit code %s%s",
                h.worker,
                h.process.pid,
                "died" if booted else "failed to start",
                h.process.exitcode,
                f" holding task {h.task}" if h.task is not None else "",
            )
            h.process.close()
            if booted:
                self._restart_at[h.worker] = now
            else:
                self.boot_failures += 1
                self._restart_at[h.worker] = now + BOOT_BACKOFF * 2 ** (self.boot_failures - 1)
        for worker, due in list(self._restart_at.items()):
            if due <= now and not self.given_up:
                del self._restart_at[worker]
                self._handles[worker] = self._spawn(worker)
                self.restarts += 1
        return dead

    def join(self, deadline: float) -> None:
        """Join every worker by ``deadline`` (the caller has sent ``stop``), then terminate, then kill."""
        for h in self._handles.values():
            if h.routing_id is None:
                h.process.terminate()  # still starting: it holds no task and cannot hear ``stop``
        for h in self._handles.values():
            h.process.join(max(0.0, deadline - time.monotonic()))
        for h in self._handles.values():
            if h.process.exitcode is None:
                log.warning("decode worker %d did not stop in time; terminating", h.worker)
                h.process.terminate()
                h.process.join(1.0)
            if h.process.exitcode is None:
                h.process.kill()
                h.process.join(1.0)
