"""A private service for one trainer process: what ``ServiceLoader.local`` starts and stops.

The service runs as ``python -m loader_service serve`` (a separate process: the trainer side never
imports the service side) on an ipc socket of its own in the temporary folder, with
``--stop-with-stdin`` and a pipe on its stdin whose write end only this process holds, so it stops
when the loader closes and also when this process dies by any means (NOTE [ Stop with stdin ] in
loader_service/supervisor/lifeline.py). Readiness comes the way systemd gets it: ``READY=1`` on a
datagram socket named in ``NOTIFY_SOCKET``, while the process is watched so that a service that
refuses its options fails the call at once instead of after a timeout. Its log goes to this
process's standard error.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from gpu_worker.connection import ServiceError

log = logging.getLogger(__name__)

START_TIMEOUT = 600.0
"""Seconds a private service may take to be ready: it indexes the data before it listens."""
STOP_TIMEOUT = 30.0
"""Seconds it may take to stop once its stdin has closed, before SIGTERM, then SIGKILL."""
POLL = 0.2


def serve_flags(options: Mapping[str, object]) -> list[str]:
    """``serve`` flags for keyword options: ``batch_size=64`` is ``--batch-size 64``, ``strict=True``
    ``--strict``, ``strict=False`` ``--no-strict``; None leaves the option at its default."""
    flags: list[str] = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, str | int | float | os.PathLike):
            flags += [f"--{flag}", os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
        else:
            raise TypeError(f"serve option {name}: {type(value).__name__} is not a flag value")
    return flags


class LocalService:
    """One private ``loader-service serve``, ready on ``endpoint`` once constructed."""

    def __init__(self, data: str | os.PathLike[str], options: Mapping[str, object], start_timeout: float):
        name = f"dataferry-local-{os.getpid()}-{secrets.token_hex(4)}"
        self.endpoint = f"ipc://{os.path.join(tempfile.gettempdir(), name)}.sock"
        argv = [sys.executable, "-m", "loader_service", "serve", "--data", os.fspath(data)]
        argv += ["--endpoint", self.endpoint, "--stop-with-stdin", *serve_flags(options)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready:
            ready.bind("\0" + name)  # abstract: nothing on disk to leave behind
            env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID")}
            env["NOTIFY_SOCKET"] = "@" + name
            # Its own session: a Ctrl-C meant for the trainer reaches the trainer, which then closes.
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, start_new_session=True)
            try:
                self._wait_ready(ready, start_timeout)
            except BaseException:
                self.stop()
                raise
        log.info("private service %d ready on %s", self.process.pid, self.endpoint)

    def _wait_ready(self, ready: socket.socket, timeout: float) -> None:
        ready.settimeout(POLL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if b"READY=1" in ready.recv(4096).split(b"\n"):
                    return
            except TimeoutError:
                pass
            code = self.process.poll()
            if code is not None:
                raise ServiceError(
                    f"the private service exited with code {code} before it was ready: "
                    "its messages are above, on standard error"
                )
            if time.monotonic() > deadline:
                raise ServiceError(f"the private service was not ready within {timeout:.0f} s")

    def stop(self) -> int:
        """End of file on its stdin, the stop it is waiting for; SIGTERM, then SIGKILL, if it hangs.
        Its exit code (negative: the signal that ended it)."""
        process = self.process
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        for escalate in (None, process.terminate, process.kill):
            if escalate is not None:
                log.warning("private service %d did not stop; %s", process.pid, escalate.__name__)
                escalate()
            try:
                code = process.wait(STOP_TIMEOUT)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            code = process.wait()
        if code:
            log.warning("private service %d exited with code %d", process.pid, code)
        return code
