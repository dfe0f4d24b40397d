"""``loader-service serve`` as a child of the benchmark, stopped cleanly or not left behind at all.

NOTE [ Benchmark service lifecycle ]
    * The service runs as ``python -m loader_service serve`` in its own process group
      (``start_new_session=True``), so a Ctrl-C on the terminal reaches only the benchmark, which
      then decides how the service stops; its decode workers share that group.
    * Normal end: SIGTERM, wait, and require exit code 0 and no segment of that service left in
      /dev/shm. Anything else fails the run, with the tail of the service's log.
    * Every other path (an exception, Ctrl-C, a timeout, SIGTERM to the benchmark, which ``cli``
      turns into SystemExit): SIGKILL to the whole group, reap, then remove the segments the killed
      service could not (their names carry its pid). No process and no ``dataferry-*`` segment
      outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.proctree import service_segments

READY_MARK = "ready: "
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says what failed (and shows the service log)."""


@dataclass(frozen=True)
class ServiceSpec:
    """The flags of one ``loader-service serve``."""

    data: Path
    endpoint: str
    workers: int
    batch_size: int
    image_size: int
    augment: str = "train"
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    sources: tuple[tuple[str, Path], ...] = ()
    """Named sources, served as ``--source NAME=DATA`` each instead of ``--data`` (``data`` then
    only says where the images are)."""

    def argv(self) -> list[str]:
        data = [a for name, path in self.sources for a in ("--source", f"{name}={path}")]
        return [
            sys.executable, "-m", "loader_service", "serve",
            *(data or ["--data", str(self.data)]),
            "--endpoint", self.endpoint,
            "--workers", str(self.workers),
            "--batch-size", str(self.batch_size),
            "--image-size", str(self.image_size),
            "--augment", self.augment,
            "--seed", str(self.seed),
            *self.extra_args,
        ]  # fmt: skip


class ServiceProcess:
    """One running service; its log (stderr) goes to a file so that a full pipe can never stall it."""

    def __init__(self, spec: ServiceSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.exit_code: int | None = None
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                spec.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Block until the service logs that it is ready; fail if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while READY_MARK not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise BenchError(
                    f"service exited with {self.proc.returncode} before ready:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"service not ready within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM; require exit code 0 and no segment left (NOTE [ Benchmark service lifecycle ])."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise BenchError(
                f"service did not stop within {timeout:.0f} s of SIGTERM:\n{self.log_tail()}"
            ) from None
        left = service_segments(self.pid)
        self.kill_group()  # decode workers must not outlive a service that exited badly
        if self.exit_code != 0 or left:
            left_text = f"{len(left)} segment(s) left in /dev/shm"
            raise BenchError(f"service exit code {self.exit_code}, {left_text}:\n{self.log_tail()}")
        return self.exit_code

    def kill_group(self) -> None:
        """SIGKILL the service's whole process group, reap it, remove what it left in /dev/shm."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_TIMEOUT)
        for path in service_segments(self.pid):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def running_service(spec: ServiceSpec, log_path: Path) -> Iterator[ServiceProcess]:
    """A ready service for the ``with`` body; stopped cleanly after it, killed if the body fails."""
    service = ServiceProcess(spec, log_path)
    clean = False
    try:
        service.wait_ready()
        yield service
        clean = True
    finally:
        if clean:
            service.stop()
        else:
            service.kill_group()


@contextlib.contextmanager
def serving(run_dir: Path, args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """``loader-service serve --endpoint E *args`` on a fresh ipc endpoint in ``run_dir``, for the
    ``with`` body: (E, its pid). SIGTERM after it, SIGKILL if it has not exited in 30 s. For the
    module benchmarks (objectstore, sizing) that read a service as a trainer does and need no log."""
    endpoint = f"ipc://{run_dir}/s{len(os.listdir(run_dir))}.sock"
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "loader_service", "serve", "--endpoint", endpoint, *args],
        cwd=repo,
        env={**os.environ, **(env or {})},
    )
    try:
        yield endpoint, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
