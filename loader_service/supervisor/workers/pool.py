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
    share) and exits when it is gone; the template exits then too, when the last holder of its
    pipe (the service, its workers) is gone. A template that dies (the OOM killer, or killed for
    not answering: NOTE [ A template that does not answer ]) takes with it what the service knows
    of its workers' exits: each is then taken for dead, ended if it still runs (``end_orphan``),
    and replaced from a new template, its task redone, as for any worker that dies (NOTE [ Worker
    restarts ]).
"""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from loader_service.decode.contract import BENCH_WRITE_NOTHING_ENV, WORKER_BOOT_ERROR, WorkerConfig
from loader_service.supervisor.rates import RateMeter
from loader_service.supervisor.workers.template import BOOT_DEADLINE, WorkerTemplate, end_orphan

log = logging.getLogger(__name__)
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
    starting: bool = False
    """Asked of the template, not answered yet: no pid (NOTE [ A template that does not answer ])."""
    early: tuple[int, bytes] | None = None
    """A ``w_ready`` (pid, routing id) that came before the template's answer."""

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
        self,
        config: WorkerConfig,
        count: int,
        spawn: Spawner | None = None,
        active: int | None = None,
        folder: Path | None = None,
    ) -> None:
        """``spawn``: a stand-in that starts a worker at once, for tests; by default workers are
        forked from the template, asked off the main loop (NOTE [ A template that does not answer ]),
        which starts in ``folder``, the service's private one (NOTE [ Nothing from the working
        folder ])."""
        self._config = config
        self._spawner = spawn
        if spawn is None and folder is None:
            raise ValueError("workers forked from a template need the service's private folder")
        self._template = WorkerTemplate(config, folder) if spawn is None and folder else None
        self.most = count
        """The most workers there may be (``--workers``, or what ``auto`` may use)."""
        self._active = count if active is None else max(1, min(count, active))
        self._lost: list[WorkerHandle] = []
        """Killed workers that would not exit, watched until they do."""
        self._restart_at: dict[int, float] = {}
        self._gone_busy = 0.0
        """Seconds on tasks of workers that are gone."""
        self.restarts = 0
        self.boot_failures = 0
        self._handles = {i: self._spawn(i) for i in range(self._active)}
        if self._template is not None:  # ready with its first workers forked, as the template boots once
            self._template.settle(time.monotonic() + BOOT_DEADLINE)
            self._collect_starts(time.monotonic())

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
        config = replace(self._config, worker=worker)
        if self._template is not None:
            return WorkerHandle(worker, self._template.ask(config), starting=True)
        assert self._spawner is not None
        process = self._spawner(config)
        log.info("started decode worker %d (pid %s)", worker, process.pid)
        return WorkerHandle(worker, process)

    def _collect_starts(self, now: float) -> None:
        """The template's answers: each worker started, or failed to start (NOTE [ A template that
        does not answer ]); a ``w_ready`` it sent meanwhile is taken now."""
        if self._template is None:
            return
        for process, why in self._template.answered():
            h = next((h for h in self._handles.values() if h.process is process), None)
            if h is None:
                continue
            h.starting = False
            if why:
                log.error(
                    "decode worker %d failed to start: its template did not fork it (%s)", h.worker, why
                )
                self._forget(h, now)
                self._failed_to_start(h.worker, now)
                continue
            log.info("started decode worker %d (pid %s)", h.worker, process.pid)
            if h.early is not None and h.early[0] == process.pid:
                self.mark_ready(h, h.early[1])

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
            if self._overran(h, now, limit):
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

    def on_ready(self, worker: int, pid: int, routing_id: bytes) -> None:
        """A worker said ``w_ready``: taken if it is the process the service started for it, held
        if the template's answer (its pid) has not been collected yet."""
        handle = self._handles.get(worker)
        if handle is None:
            return
        if handle.starting:
            handle.early = (pid, routing_id)
        elif handle.process.pid == pid:
            self.mark_ready(handle, routing_id)

    @property
    def template_restarts(self) -> int:
        """Templates killed for not answering (NOTE [ A template that does not answer ])."""
        return 0 if self._template is None else self._template.restarts

    def _overran(self, h: WorkerHandle, now: float, limit: float) -> bool:
        """Alive on one sample longer than ``limit``, not killed yet: one that is gone is not stuck,
        its exit only unreported (NOTE [ A template that does not answer ])."""
        if h.task is None or h.killed_at is not None or now - h.task_since <= limit:
            return False
        return not self._exited(h)

    def _exited(self, handle: WorkerHandle) -> bool:
        """Gone, whatever its template has reported (NOTE [ A template that does not answer ])."""
        return self._template is not None and self._template.exited(handle.process)

    def mark_ready(self, handle: WorkerHandle, routing_id: bytes) -> None:
        handle.routing_id = routing_id
        handle.ready_at = time.monotonic()
        self.boot_failures = 0

    def reap(self, now: float) -> list[WorkerHandle]:
        """Collect workers that exited and start the replacements that are due; return the dead."""
        self._collect_starts(now)
        if self._template is not None:
            self._template.check(now)
        self._reap_lost()
        dead = [h for h in self._handles.values() if h.process.exitcode is not None]
        for h in dead:
            end_orphan(h.process.pid)
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
                self._failed_to_start(h.worker, now)
        for worker, due in list(self._restart_at.items()):
            if due <= now and not self.given_up:
                del self._restart_at[worker]
                self._handles[worker] = self._spawn(worker)
                self.restarts += 1
        return dead

    def _failed_to_start(self, worker: int, now: float) -> None:
        self.boot_failures += 1
        self._restart_at[worker] = now + BOOT_BACKOFF * 2 ** (self.boot_failures - 1)

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
        """Join every worker by ``deadline`` (the caller has sent ``stop``), then terminate, then
        kill. A template that owes the exit of a worker that is gone is killed first, and one that
        owes any exit at the end, so that no join, here or at exit, waits on it (NOTE [ A template
        that does not answer ])."""
        if self._template is not None:
            self._template.close(deadline)
            self._collect_starts(time.monotonic())
        started = [h for h in self._handles.values() if not h.starting]
        for h in started:
            if h.routing_id is None:
                h.process.terminate()  # still starting: it holds no task and cannot hear ``stop``
        for h in [*started, *self._lost]:
            h.process.join(max(0.0, deadline - time.monotonic()))
        self._end_silent_template(started, self._exited)
        late = [h for h in started if h.process.exitcode is None]
        for h in late:
            log.warning("decode worker %d did not stop in time; terminating", h.worker)
            h.process.terminate()
        _join_all(late, time.monotonic() + 1.0)  # one second for them all, not one each
        self._end_silent_template(late, self._exited)  # gone, and the template has not said so
        for h in late:
            if h.process.exitcode is None:
                h.process.kill()
        _join_all(late, time.monotonic() + 1.0)
        self._end_silent_template([*started, *self._lost], lambda h: True)
        if self._template is not None:
            self._template.release()

    def _end_silent_template(self, handles: list[WorkerHandle], gone: Callable[[WorkerHandle], bool]) -> None:
        """At shutdown: kill the template if a worker ``gone`` has no exit reported, and take the
        exits its death makes known."""
        if self._template is None:
            return
        silent = [h for h in handles if h.process.exitcode is None and gone(h)]
        if silent:
            self._template.condemn(f"the exit of worker {silent[0].worker} unreported at shutdown")
            for h in silent:
                h.process.join(1.0)


def _warm(handle: WorkerHandle, now: float) -> bool:
    ready = handle.ready_at
    return ready is not None and (handle.on_tasks > 0 or now - ready >= WARM)


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


def _join_all(handles: list[WorkerHandle], deadline: float) -> None:
    """Join ``handles`` by one ``deadline``: a template that reports no exit costs it once, not once
    a worker (NOTE [ A template that does not answer ])."""
    for h in handles:
        h.process.join(max(0.0, deadline - time.monotonic()))
