"""The service's side of ``--workers auto`` (NOTE [ Sizing workers ] in rule.py): the controller
made from the config, fed every quarter second from the workers, the feeds and the trainers'
heartbeats, its decisions applied to the worker set, and what status shows of it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from loader_service.config import ServiceConfig
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.trainers.load import step_seconds, weighted_demand
from loader_service.supervisor.trainers.sessions import Session
from loader_service.supervisor.workers.pool import WorkerSet
from loader_service.supervisor.workers.sizing.rule import Sample, Sizer
from protocol.status import SizingStatus

log = logging.getLogger(__name__)
TICK = 0.25
"""Seconds between the totals the controller is fed: a trainer's waiting heartbeat is acted on
within this much (NOTE [ Sizing workers ]); status and metrics stay at once a second."""


class WorkerSizing:
    """The controller over ``workers`` (None: the count is pinned by ``--workers N``)."""

    def __init__(self, config: ServiceConfig, workers: WorkerSet) -> None:
        self.workers = workers
        self.sizer: Sizer | None = None
        self._last = -TICK
        if config.workers:
            log.info("decode workers: %d (--workers)", config.workers)
            return
        budget = config.budget
        log.info(
            "decode workers: auto, %d taking tasks, up to %d; CPU budget %.2f cores (%s)",
            config.first_workers,
            config.worker_processes,
            budget.cores,
            budget.source,
        )
        self.sizer = Sizer(config.first_workers, config.worker_processes, budget.cores)

    def tick(self, now: float, feeds: Sequence[Feed], sessions: Iterable[Session]) -> None:
        """Called on every turn of the main loop: every ``TICK`` seconds, the totals the controller
        reads, and its decision applied."""
        sizer, workers = self.sizer, self.workers
        if sizer is None or now - self._last < TICK:
            return
        self._last = now
        images = sum(feed.counters.decoded.total for feed in feeds)
        sample = Sample(now, workers.busy_seconds(now), workers.cpu_seconds(), images)
        loops = [s.loop for s in sessions]
        # A window with a worker booting (at start, or a replacement) measures the boot, not the work.
        measured = len(loops) if workers.all_active_ready(now) else 0
        changed = sizer.tick(
            sample,
            lambda since: weighted_demand(loops, since),
            measured,
            lambda since: step_seconds(loops, since),
        )
        if changed is not None:
            workers.active = changed

    def status(self) -> SizingStatus:
        """Workers taking tasks and started, and why, for status and metrics."""
        if self.sizer is not None:
            return self.sizer.status(time.monotonic(), self.workers.started)
        count = self.workers.active
        return SizingStatus(mode="pinned", active=count, started=self.workers.started, most=count)
