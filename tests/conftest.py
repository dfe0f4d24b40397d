"""Shared fixtures: sample datasets, real service processes, and a /dev/shm leak check.

Every service a test starts runs in its own process group and is stopped (SIGTERM, then SIGKILL of
the whole group) when the test ends, pass or fail. Any ``dataferry-*`` segment that appears during a
test and is still there afterwards fails that test and is removed, so one leak cannot hide another.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loader_service.sample_data import make_sample_dataset

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[1]


def our_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("dataferry-")}


def _owner_running(segment: str) -> bool:
    """Is the service whose pid is in ``segment``'s name still running (another run's, say)?"""
    head = segment[len("dataferry-") :].split("-", 1)[0]
    return head.isdigit() and Path(f"/proc/{head}").exists()


@pytest.fixture(autouse=True)
def no_shm_leaks() -> Iterator[None]:
    before = our_segments()
    yield
    # Every service this test started has been stopped by now; a segment whose service still runs
    # belongs to something else on the machine (a benchmark, another test run) and is not ours.
    leaked = {name for name in our_segments() - before if not _owner_running(name)}
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


@pytest.fixture(scope="session")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small photo-like ImageFolder dataset: 3 classes x 30 JPEGs at ImageNet-like sizes."""
    root = tmp_path_factory.mktemp("photos") / "data"
    make_sample_dataset(root, classes=3, per_class=30, seed=7)
    return root


class ServiceProcess:
    """``loader-service serve`` as a child process, with its stderr collected line by line."""

    def __init__(self, args: list[str], endpoint: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.endpoint = endpoint
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loader_service", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0, count: int = 1) -> re.Match[str]:
        """Wait for ``count`` stderr lines matching ``pattern``; fail with the log if the process exits."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        found = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        found += 1
                        if found >= count:
                            return m
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"service exited ({self.proc.returncode}) before {pattern!r}:\n{self.log}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.log}")
                self._changed.wait(remaining)

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"service did not stop within {timeout} s:\n{self.log}") from None
        self._close_pipe()
        return code

    def _close_pipe(self) -> None:
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._close_pipe()


ServiceFactory = Callable[..., ServiceProcess]


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``start_service(data, **flags)`` -> a running service listening on an ipc endpoint in tmp_path."""
    started: list[ServiceProcess] = []

    def start(data: Path, *, wait_ready: bool = True, name: str = "feed", **flags: object) -> ServiceProcess:
        endpoint = f"ipc://{tmp_path}/{name}.sock"
        args = ["serve", "--data", str(data), "--endpoint", endpoint]
        for key, value in {"workers": 2, "batch_size": 8, "image_size": 32, **flags}.items():
            flag = f"--{key.replace('_', '-')}"
            args += [flag] if value is True else [flag, str(value)]
        service = ServiceProcess(args, endpoint)
        started.append(service)
        if wait_ready:
            service.wait_for(r"ready: ")
        return service

    yield start
    for service in started:
        print(f"--- service log (exit {service.proc.poll()}):\n{service.log[-6000:]}")
        try:
            if service.proc.poll() is None:
                service.stop()
        finally:
            service.kill_group()  # also reaps stray workers and closes the log pipe
