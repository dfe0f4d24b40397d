"""Spawning, watching and replacing decode worker processes.

The service's main loop asks this module three things each turn: which workers are idle, which have
died (their tasks must be redone), and to start replacements. A worker is idle once it has said
``w_ready`` and holds no task.

NOTE [ Workers from a template ]
    Workers are started with one frozen ``WorkerConfig`` each through multiprocessing's
    ``forkserver``: a process started once, clean (no socket, no thread of the service's), that has
    imported the decode worker (numpy, OpenCV, ZeroMQ, the formats) and forks each worker from
    itself. A worker then starts in milliseconds instead of the second its imports take, and the
    pages those imports made stay shared between all of them until written. So the service starts
    only the workers that take tasks (``active``) and starts more the moment the sizing controller
    asks for them, instead of four per core at start, parked, each a whole interpreter (measured:
    30 MiB of its own a worker, 153 MiB with a pipeline that imports torch; 256 processes on a
    64-core host). A worker parked after a decrease stays started, so the most ever started is what
    the controller once wanted. A worker's parent is the template, not the service, so a worker
    watches the service process itself (its pid and start time, which a recycled pid does not
    share) and exits when it is gone; the template exits then too. A template that dies (the OOM
    killer) takes with it what the service knows of its workers' exits: each is then taken for
    dead, ended if it still runs (``_end_orphan``), and replaced from a new template, its task
    redone, as for any worker that dies (NOTE [ Worker restarts ]).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from loader_service.decode.contract import (
    BENCH_WRITE_NOTHING_ENV,
    PIPELINES_ENV,
    WORKER_BOOT_ERROR,
    WorkerConfig,
)
from loader_service.decode.entry import worker_main
from loader_service.supervisor.rates import RateMeter

log = logging.getLogger(__name__)
_TEMPLATE = multiprocessing.get_context("forkserver")
BOOT_BACKOFF = 0.25
MAX_BOOT_FAILURES = 5
WARM = 1.0
"""Seconds a worker that has finished no task yet counts as warming up (``all_active_ready``)."""
LOST_AFTER = 5.0
"""Seconds a worker may take to exit after SIGKILL before it is given up for lost (NOTE [ Stuck workers ])."""
Spawner = Callable[[WorkerConfig], multiprocessing.process.BaseProcess]
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class WorkerHandle:
    worker: int
    process: multiprocessing.process.BaseProcess
    routing_id: bytes | None = None
    task: int | None = None
    """The task id this worker is decoding, if any."""
    task_since: float = 0.0
    """When its task began, or when it last finished a sample of it (NOTE [ Per-sample progress ])."""
    samples_done: int = 0
    answers: int = 0
    """The store's answers to its reads, as last seen (NOTE [ Waiting on the store ])."""
    decoded: RateMeter = field(default_factory=RateMeter)
    killed_at: float | None = None
    """When it was killed for overrunning its task; it is killed (and logged) only once."""
    task_started: float = 0.0
    on_tasks: float = 0.0
    """Seconds spent on finished tasks (NOTE [ Fleet load ])."""
    ready_at: float | None = None
    """When it said ``w_ready``."""

    @property
    def idle(self) -> bool:
        return self.routing_id is not None and self.task is None

    def busy_seconds(self, now: float) -> float:
        """Seconds on tasks so far, the one under way included."""
        return self.on_tasks + (now - self.task_started if self.task is not None else 0.0)


class WorkerSet:
    """NOTE [ Worker restarts ]
    A worker that dies after it has said ``w_ready`` (SIGKILL, OOM, a crash inside OpenCV) is
    replaced at once and its task is redone. A worker that dies before ``w_ready``, or exits with
    ``WORKER_BOOT_ERROR``, failed to start: it is restarted after a doubling delay, and after
    ``MAX_BOOT_FAILURES`` such failures in a row ``given_up`` turns true and the service stops with
    a fatal error instead of restarting forever.

    NOTE [ Stuck workers ]
    A worker that finishes no sample of its task within the task timeout (a read that never
    returns, a decoder that loops; NOTE [ Per-sample progress ]) is sent SIGKILL once and logged
    once. Normally it exits at once and ``reap`` replaces it like any dead worker. A process in
    uninterruptible sleep (a hung network filesystem) cannot die until the kernel call returns; if
    it has not exited ``LOST_AFTER`` seconds after the kill, it is
    given up for lost, once: a replacement starts, its task is redone, and the old pid is watched
    (never again signalled or logged) until it finally exits. Redoing its batch into the same slot
    is safe because a SIGKILLed process never runs user code again, and workers read files into
    their own buffers, never straight into slot memory: the kernel cannot write into the slot on
    its behalf when it wakes.
    """

    def __init__(
        self, template: WorkerConfig, count: int, spawn: Spawner | None = None, active: int | None = None
    ) -> None:
        self._template = template
        self._start_process = spawn or _spawn_process
        if spawn is None:
            prepare_template(template)
        self.most = count
        """The most workers there may be (``--workers``, or what ``auto`` may use)."""
        self._active = count if active is None else max(1, min(count, active))
        self._handles = {i: self._spawn(i) for i in range(self._active)}
        self._lost: list[WorkerHandle] = []
        """Killed workers that would not exit, watched until they do."""
        self._restart_at: dict[int, float] = {}
        self._gone_busy = 0.0
        """Seconds on tasks of workers that are gone."""
        self.restarts = 0
        self.boot_failures = 0

    @property
    def active(self) -> int:
        """NOTE [ Sizing workers ]: workers ``0 .. active - 1`` take tasks; those above it that were
        started are parked. Raising it starts the workers never started, from the template (NOTE
        [ Workers from a template ]): they take tasks once they are ready."""
        return self._active

    @active.setter
    def active(self, count: int) -> None:
        self._active = max(1, min(self.most, count))
        for worker in range(self._active):
            if worker not in self._handles and worker not in self._restart_at:
                self._handles[worker] = self._spawn(worker)

    @property
    def started(self) -> int:
        """Worker processes there are now, parked ones included."""
        return len(self._handles)

    @property
    def given_up(self) -> bool:
        return self.boot_failures >= MAX_BOOT_FAILURES

    def _spawn(self, worker: int) -> WorkerHandle:
        process = self._start_process(replace(self._template, worker=worker))
        log.info("started decode worker %d (pid %s)", worker, process.pid)
        return WorkerHandle(worker, process)

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self._handles.values())

    def get(self, worker: int) -> WorkerHandle | None:
        return self._handles.get(worker)

    def idle(self) -> list[WorkerHandle]:
        """Workers that may take a task now: ready, without one, and not parked."""
        return [h for h in self._handles.values() if h.idle and h.worker < self.active]

    def cpu_seconds(self) -> float:
        """Seconds the workers taking tasks have run on a CPU or waited, runnable, for one (NOTE
        [ Sizing workers ]): what they would have used on an idle machine. A worker that is gone
        takes its share with it, so callers read differences over a short window. Parked workers
        are left out: their CPU is their boot's, not what a task costs."""
        return sum(_process_cores(h.process.pid) for h in self._handles.values() if h.worker < self.active)

    def all_active_ready(self, now: float) -> bool:
        """Is every worker that may take tasks started, ready and warm (none booting or replaced)?
        A worker just forked from the template is warm once it has finished a task, or after
        ``WARM`` seconds ready: its first task pays the pages it touches for the first time,
        which a window measuring an addition's gain would take for the workers' speed."""
        taking = [h for h in self._handles.values() if h.worker < self.active]
        return len(taking) == self.active and all(_warm(h, now) for h in taking)

    def busy_seconds(self, now: float) -> float:
        """Seconds every worker there has been spent on tasks (NOTE [ Fleet load ])."""
        return self._gone_busy + sum(h.busy_seconds(now) for h in self._handles.values())

    def _forget(self, handle: WorkerHandle, now: float) -> None:
        del self._handles[handle.worker]
        self._gone_busy += handle.busy_seconds(now)

    def check_stuck(self, now: float, limit: float, lost_after: float = LOST_AFTER) -> list[WorkerHandle]:
        """Kill workers that finished no sample for ``limit``; return those given up for lost, whose
        tasks must be redone now (NOTE [ Stuck workers ])."""
        for h in self._handles.values():
            if h.task is not None and h.killed_at is None and now - h.task_since > limit:
                log.error(
                    "decode worker %d (pid %s) spent over %.0f s on one sample of task %s; killing it",
                    h.worker,
                    h.process.pid,
                    limit,
                    h.task,
                )
                h.killed_at = now
                h.process.kill()
        lost = [
            h
            for h in self._handles.values()
            if h.killed_at is not None and now - h.killed_at > lost_after and h.process.exitcode is None
        ]
        for h in lost:
            log.error(
                "decode worker %d (pid %s) has not exited %.0f s after SIGKILL (uninterruptible sleep?); "
                "starting a replacement, redoing task %s, and watching the old process until it exits",
                h.worker,
                h.process.pid,
                lost_after,
                h.task,
            )
            self._forget(h, now)
            self._lost.append(h)
            self._restart_at[h.worker] = now
        return lost

    def mark_ready(self, handle: WorkerHandle, routing_id: bytes) -> None:
        handle.routing_id = routing_id
        handle.ready_at = time.monotonic()
        self.boot_failures = 0

    def reap(self, now: float) -> list[WorkerHandle]:
        """Collect workers that exited and start the replacements that are due; return the dead."""
        self._reap_lost()
        dead = [h for h in self._handles.values() if h.process.exitcode is not None]
        for h in dead:
            _end_orphan(h.process.pid)
            self._forget(h, now)
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

    def _reap_lost(self) -> None:
        for h in [h for h in self._lost if h.process.exitcode is not None]:
            log.info("lost decode worker (pid %s) finally exited", h.process.pid)
            h.process.close()
            self._lost.remove(h)

    @property
    def lost(self) -> int:
        """Killed workers that have not exited yet."""
        return len(self._lost)

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
        for h in self._lost:
            h.process.join(max(0.0, deadline - time.monotonic()))


def _end_orphan(pid: int | None) -> None:
    """A worker is known dead through its template; a template that died (the OOM killer) leaves
    its workers running without one, their exit unknown (NOTE [ Workers from a template ]). Such a
    worker, forked from a template (its command line says so) and whose parent is no longer one,
    is ended here, so its replacement does not run beside it."""
    if pid is None or not _forked_from_template(pid):
        return
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return
    if not _forked_from_template(parent):
        log.warning("decode worker (pid %d) outlived its template; ending it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _forked_from_template(pid: int) -> bool:
    try:
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _warm(handle: WorkerHandle, now: float) -> bool:
    ready = handle.ready_at
    return ready is not None and (handle.on_tasks > 0 or now - ready >= WARM)


def prepare_template(template: WorkerConfig) -> None:
    """What the template imports when it starts (NOTE [ Workers from a template ]): the worker, and
    the feeds' pipelines (``decode/template.py``). Before the first worker starts it."""
    pipelines = [feed.pipeline for feed in template.feeds if feed.pipeline]
    os.environ[PIPELINES_ENV] = "\n".join(pipelines)
    _TEMPLATE.set_forkserver_preload(["loader_service.decode.template"])


def _spawn_process(cfg: WorkerConfig) -> multiprocessing.process.BaseProcess:
    process = _TEMPLATE.Process(
        target=worker_main, args=(cfg,), name=f"dataferry-worker-{cfg.worker}", daemon=True
    )
    process.start()
    return process


def _process_cores(pid: int | None) -> float:
    """Seconds a process has run on a CPU plus those it waited runnable in the run queue
    (``/proc/PID/schedstat``; its CPU time from ``stat`` where that is missing); 0.0 if it is gone.
    A computing worker on a busy machine runs half the time and waits the other half: by its CPU
    alone it would look half as costly as it is, and the controller would add workers that only
    take CPU from the others (measured: 0.45 cores each, 2 workers made 4 on 2 busy cores)."""
    if pid is None:
        return 0.0
    try:
        ran, waited, _slices = Path(f"/proc/{pid}/schedstat").read_text().split()
        return (int(ran) + int(waited)) / 1e9
    except (OSError, ValueError):
        pass
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def write_nothing_from_env() -> bool:
    """The benchmark-only hook BENCH_WRITE_NOTHING_ENV, read once, where the workers' config is made."""
    if os.environ.get(BENCH_WRITE_NOTHING_ENV) != "1":
        return False
    log.warning(
        "%s=1: decode workers write nothing (a benchmark of the main loop); batches hold no pixels",
        BENCH_WRITE_NOTHING_ENV,
    )
    return True
