"""The decode workers' template as the service's main loop sees it: each worker start asked of it on
a thread and collected at a later turn of the loop, each answered by a deadline, and each worker
exit it owes watched; a template that misses either is killed and replaced (NOTE [ A template that
does not answer ])."""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import select
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from loader_service.decode.contract import PIPELINES_ENV, TEMPLATE_FOLDER_ENV, WorkerConfig, parse_spec
from loader_service.decode.entry import worker_main
from loader_service.working_folder import moved_to

log = logging.getLogger(__name__)
_CONTEXT = multiprocessing.get_context("forkserver")
Process = multiprocessing.process.BaseProcess
ANSWER_DEADLINE = 5.0
"""Seconds a running template may take to fork a worker, or to report a worker's exit: it takes
milliseconds when it answers at all."""
BOOT_DEADLINE = 60.0
"""Seconds a template just started may take to fork its first worker: it imports the decoder and
the feeds' pipelines first (0.4 s here with the built-in transforms; seconds with torch)."""
WAKE = 1.0
"""Seconds the asking thread sleeps at most between looks at its queue."""


@dataclass
class _Asked:
    """The start the thread is waiting on, and by when the template must answer it."""

    deadline: float
    limit: float


@dataclass
class _Owed:
    """A worker the template forked: its exit is the template's to report."""

    process: Process
    unreported_since: float | None = None


class WorkerTemplate:
    """NOTE [ A template that does not answer ]
    The template (NOTE [ Workers from a template ]) answers two things: the pid of each worker it
    forks, and the exit of each one. Either may never come: a template stopped (SIGSTOP, a
    debugger), starved or hung answers nothing, and multiprocessing waits for a fork's pid without
    a timeout. So the main loop never asks it anything itself: a start is queued to one thread that
    asks (``Process.start``) and the loop collects the answer at a later turn (``answered``); until
    then the worker has no pid, and a ``w_ready`` it sends meanwhile is held until the pid is known
    (``WorkerSet.on_ready``). Each exit is watched by the loop too, through a pidfd per worker
    (one ``poll`` a turn for all of them), since the template is the worker's parent: a worker
    gone whose exit the template has not reported is owed.

    A start unanswered ``ANSWER_DEADLINE`` seconds after it was asked (``BOOT_DEADLINE`` for the
    first start of a template just started, which imports first), or an exit owed that long,
    declares the template dead: it is logged, counted (``template_restarts`` in status), killed
    (SIGKILL, which a stopped process cannot hold off) and reaped by the thread, which starts a
    new template at the next start. The kill closes what the template held, so the start in flight
    fails (a start that failed to answer counts as a worker that failed to start: NOTE [ Worker
    restarts ]) and every worker's exit reads as known; they are all ended and replaced from the
    new template, their tasks redone, as when the template is killed outright (NOTE [ Workers from
    a template ]). Meanwhile the loop serves trainers: status answers, heartbeats flow, the workers
    still running decode. At shutdown the start in flight gets its deadline at most, and a
    template that still owes a worker's exit is killed, so that nothing at exit waits on it for
    long: workers that do not stop when asked are terminated, then killed, within one second each
    step for them all (not one second a worker), and a template that leaves a terminated worker's
    exit unreported is killed between the two.
    Where pidfds are missing (Linux before 5.3), a dead worker's task is still taken back by the
    task timeout (NOTE [ Stuck workers ]), and its replacement's start has its deadline.
    """

    def __init__(self, config: WorkerConfig, folder: Path) -> None:
        """``folder``: the service's private runtime folder, where the template and the resource
        tracker start (NOTE [ Nothing from the working folder ])."""
        _prepare(config)
        self._folder = folder
        self._changed = threading.Condition()
        self._queue: deque[Process] = deque()
        self._asking: _Asked | None = None
        self._answers: list[tuple[Process, str]] = []
        self._killed: int | None = None
        """The last template killed: it is killed once."""
        self._to_bury: int | None = None
        """A template killed, for the thread to reap."""
        self._closed = False
        self._owed: dict[int, _Owed] = {}
        """By pidfd: the workers whose exit the template is to report."""
        self._exits = select.poll()
        self.restarts = 0
        """Templates killed for not answering."""
        self._thread = threading.Thread(target=self._run, name="dataferry-template", daemon=True)
        self._thread.start()

    # --- the main loop's side -------------------------------------------------------------------

    def ask(self, config: WorkerConfig) -> Process:
        """A worker, to be started by the thread; its pid is known once ``answered`` returns it."""
        process = _CONTEXT.Process(
            target=worker_main, args=(config,), name=f"dataferry-worker-{config.worker}", daemon=True
        )
        with self._changed:
            self._queue.append(process)
            self._changed.notify()
        return process

    def settle(self, deadline: float) -> None:
        """At start-up, before the loop runs: wait until ``deadline`` at most for every start asked
        so far to be answered, so that the service says it is ready with its first workers forked."""
        with self._changed:
            while self._queue or self._asking is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(min(WAKE, left))

    def answered(self) -> list[tuple[Process, str]]:
        """The starts answered since the last call: each process, and why it failed ("" if started)."""
        with self._changed:
            answers, self._answers = self._answers, []
        for process, why in answers:
            if not why:
                self._watch(process)
        return answers

    def check(self, now: float) -> None:
        """Declare the template dead if a start or a worker's exit it owes is overdue."""
        with self._changed:
            asking = self._asking
        if asking is not None and now > asking.deadline:
            self.condemn(f"forked no worker within {asking.limit:.0f} s")
        for fd, _event in self._exits.poll(0) if self._owed else ():
            owed = self._owed[fd]
            if _reported(owed.process):
                self._unwatch(fd)
            elif owed.unreported_since is None:
                owed.unreported_since = now
            elif now - owed.unreported_since > ANSWER_DEADLINE:
                self.condemn(
                    f"the exit of worker pid {owed.process.pid} unreported for {ANSWER_DEADLINE:.0f} s"
                )

    def exited(self, process: Process) -> bool:
        """Has this worker exited, whatever the template has reported? A worker that is gone is not
        stuck (NOTE [ Stuck workers ]): its task waits for the exit, reported or owed."""
        fd = next((fd for fd, owed in self._owed.items() if owed.process is process), None)
        if fd is None:
            return False
        one = select.poll()  # not select(): a pidfd may be numbered past FD_SETSIZE
        one.register(fd, select.POLLIN)
        return bool(one.poll(0))

    def condemn(self, why: str) -> None:
        """Kill the template, once (NOTE [ A template that does not answer ])."""
        pid = _template_pid()
        if pid is None or pid == self._killed:
            return
        self._killed = pid
        with self._changed:
            self._to_bury = pid
            self._changed.notify()
        then = "" if self._closed else ", and forking its workers again from a new one"
        log.error("workers' template (pid %d) did not answer: %s; killing it%s", pid, why, then)
        self.restarts += 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def close(self, deadline: float) -> None:
        """Ask nothing more: the start in flight gets until ``deadline`` or its own, whichever is first."""
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify()
            asking = self._asking
        wait = deadline if asking is None else min(deadline, asking.deadline)
        self._thread.join(max(0.0, wait - time.monotonic()))
        if self._thread.is_alive():
            self.condemn("still forking a worker at shutdown")
            self._thread.join(WAKE)

    def release(self) -> None:
        """Close the exit watches (after the workers are joined)."""
        for fd in list(self._owed):
            self._unwatch(fd)

    def _watch(self, process: Process) -> None:
        if process.pid is None:
            return
        try:
            fd = os.pidfd_open(process.pid)
        except (OSError, AttributeError):  # gone already, or no pidfds here: the task timeout remains
            return
        self._owed[fd] = _Owed(process)
        self._exits.register(fd, select.POLLIN)

    def _unwatch(self, fd: int) -> None:
        self._exits.unregister(fd)
        os.close(fd)
        del self._owed[fd]

    # --- the asking thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                while not (self._queue or self._closed or self._to_bury is not None):
                    self._changed.wait(WAKE)
                process = None if self._closed or not self._queue else self._queue.popleft()
                if process is not None:
                    self._asking = _Asked(math.inf, 0.0)  # taken: ``settle`` waits for it too
            self._bury()
            if process is not None:
                self._ask(process)
            elif self._closed:
                return

    def _ask(self, process: Process) -> None:
        booting = not _running(_template_pid())
        limit = BOOT_DEADLINE if booting else ANSWER_DEADLINE
        with self._changed:
            self._asking = _Asked(time.monotonic() + limit, limit)
        why = ""
        try:
            if booting or not _running(_tracker_pid()):
                start_from(self._folder)  # NOTE [ Nothing from the working folder ]
            process.start()
        except Exception as exc:  # the template was killed while asked, or could not start
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        with self._changed:
            self._asking = None
            self._answers.append((process, why))
            self._changed.notify_all()

    def _bury(self) -> None:
        """Reap a template the loop killed, so that the next start starts a new one."""
        with self._changed:
            pid, self._to_bury = self._to_bury, None
        if pid is None or pid != _template_pid():
            return
        try:  # multiprocessing's own stop (no public name): closes its pipe, waits for it (killed)
            multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
        except Exception:  # then the next start finds it dead, reaps it and starts another
            log.exception("could not reap the workers' template (pid %d)", pid)


def start_from(folder: Path) -> None:
    """Start the resource tracker and the template, each where it is not running, with ``folder`` as
    their working folder for good: they are ``python -c``, which looks there first for imports; this
    process is back in its own on return (NOTE [ Nothing from the working folder ])."""
    with moved_to(folder):
        multiprocessing.resource_tracker.ensure_running()
        multiprocessing.forkserver.ensure_running()


def _template_pid() -> int | None:
    """The running template's pid: multiprocessing keeps it, with no public name."""
    pid: int | None = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid


def _tracker_pid() -> int | None:
    """The running resource tracker's pid: multiprocessing keeps it, with no public name."""
    pid: int | None = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    return pid


def _running(pid: int | None) -> bool:
    """Alive and not a zombie."""
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reported(process: Process) -> bool:
    try:
        return process.exitcode is not None
    except ValueError:  # closed by the pool, which closes only a process whose exit it knows
        return True


def _prepare(config: WorkerConfig) -> None:
    """What the template imports when it starts (NOTE [ Workers from a template ]): the worker, and
    the feeds' pipelines (``decode/template.py``), a ``package.module:FUNC`` one from this process's
    working folder (NOTE [ Nothing from the working folder ]). Before the first worker starts it."""
    pipelines = [feed.pipeline for feed in config.feeds if feed.pipeline]
    os.environ[PIPELINES_ENV] = "\n".join(pipelines)
    if any(not parse_spec(spec)[0].endswith(".py") for spec in pipelines):  # a module, not a file
        os.environ[TEMPLATE_FOLDER_ENV] = os.getcwd()
    else:
        os.environ.pop(TEMPLATE_FOLDER_ENV, None)
    _CONTEXT.set_forkserver_preload(["loader_service.decode.template"])


def end_orphan(pid: int | None) -> None:
    """A worker is known dead through its template; a template that died (the OOM killer, or killed
    for not answering) leaves its workers running without one, their exit unknown (NOTE [ Workers
    from a template ]). Such a worker, forked from a template (its command line says so) and whose
    parent is no longer one, is ended here, so its replacement does not run beside it."""
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
