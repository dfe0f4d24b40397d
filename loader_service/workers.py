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
from dataclasses import dataclass, replace

from loader_service.worker import WorkerConfig, run_worker

log = logging.getLogger(__name__)
_SPAWN = multiprocessing.get_context("spawn")


@dataclass
class WorkerHandle:
    worker: int
    process: multiprocessing.process.BaseProcess
    routing_id: bytes | None = None
    task: int | None = None
    """The task id this worker is decoding, if any."""

    @property
    def idle(self) -> bool:
        return self.routing_id is not None and self.task is None


class WorkerSet:
    def __init__(self, template: WorkerConfig, count: int) -> None:
        self._template = template
        self._handles = {i: self._spawn(i) for i in range(count)}
        self.restarts = 0

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

    def reap(self) -> list[WorkerHandle]:
        """Replace every worker that has exited; return the dead handles (with the task each held)."""
        dead = [h for h in self._handles.values() if h.process.exitcode is not None]
        for h in dead:
            log.error(
                "decode worker %d (pid %s) died with exit code %s%s",
                h.worker,
                h.process.pid,
                h.process.exitcode,
                f" holding task {h.task}" if h.task is not None else "",
            )
            h.process.close()
            self._handles[h.worker] = self._spawn(h.worker)
            self.restarts += 1
        return dead

    def join(self, deadline: float) -> None:
        """Join every worker by ``deadline`` (the caller has sent ``stop``), then terminate, then kill."""
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
