"""``loader-service top`` against a real service (issue 39): ``--once --json`` tells a trainer that
waits for its data from one that computes, and the live view, driven in tmux, shows the trainers,
says when the service is lost, and quits on q."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceLoader
from tests.helpers import REPO, ServiceFactory, status

pytestmark = pytest.mark.integration

HEARTBEAT = 0.25
"""Seconds between a trainer's heartbeats: its demand, which the verdict is read from, is fresh."""
TRAINED = 2.0
"""Seconds both trainers run before top looks: long enough for every heartbeat's demand to be fresh,
short enough that top's window (its start, under a second quiet, plus one second) ends well inside
the computing loop's 9 s first epoch."""


def top(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "loader_service", "top", "--endpoint", endpoint, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def loop(endpoint: str, step: float, stop: threading.Event) -> None:
    """Epochs of a loop whose step takes ``step`` seconds (0: it only pulls), until ``stop``."""
    with ServiceLoader(endpoint, timeout=30) as loader:
        while not stop.is_set():
            for _ in loader:
                time.sleep(step)
                if stop.is_set():
                    break


@contextlib.contextmanager
def trainer(endpoint: str, step: float) -> Iterator[str]:
    """A trainer thread for the ``with`` body; its session's name once it has a batch. Stopped and
    joined after the body, its failure raised."""
    known = {s["session"] for s in status(endpoint)["sessions"]}
    stop, failed = threading.Event(), []

    def run() -> None:
        try:
            loop(endpoint, step, stop)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield until(lambda: new_session(endpoint, known), 60, "the trainer attached and took a batch")
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "the trainer did not stop"
    if failed:
        raise failed[0]


def new_session(endpoint: str, known: set[str]) -> str | None:
    fresh = [s for s in status(endpoint)["sessions"] if s["session"] not in known and s["delivered"]]
    return str(fresh[0]["session"]) if fresh else None


def until(probe: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while (found := probe()) is None or found is False:
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)
    return found


def test_once_json_tells_a_waiting_trainer_from_a_computing_one(
    photos: Path, start_service: ServiceFactory
) -> None:
    """One decode worker: a loop that only pulls waits on it (input-bound), a loop whose step is
    0.2 s never does (fed). Each trainer's wait share is a number in [0, 1], with its rates.

    Batches of 2 make the computing loop's epoch 45 steps (9 s): top's one-second window falls
    inside its first epoch, never on an epoch's start, where any loop waits for its first batch
    (with batches of 8, a 2.4 s epoch, that wait fell in the window in CI and read 5-10 %)."""
    service = start_service(photos, workers=1, batch_size=2, heartbeat_interval=HEARTBEAT)
    with trainer(service.endpoint, 0.0) as waiting, trainer(service.endpoint, 0.2) as computing:
        time.sleep(TRAINED)
        took = time.monotonic()
        once = top(service.endpoint, "--once", "--json")
        took = time.monotonic() - took
        plain = top(service.endpoint, "--once")
    assert once.returncode == 0, once.stderr
    frame = json.loads(once.stdout)
    trainers = {t["session"]: t for t in frame["trainers"]}
    assert all(isinstance(t["wait_share"], float) and 0 <= t["wait_share"] <= 1 for t in trainers.values())
    assert trainers[waiting]["verdict"] in ("input-bound", "somewhat input-bound"), frame
    assert trainers[waiting]["wait_share"] > 0.2, frame
    assert trainers[computing]["verdict"] == "fed", frame
    assert trainers[waiting]["batches_per_s"] > trainers[computing]["batches_per_s"] > 0, frame
    assert trainers[computing]["images_per_s"] > 0 and 0.9 < frame["interval_s"] < 2, frame
    assert 1.0 <= took < 10, f"two snapshots a second apart took {took:.1f} s"
    assert frame["workers"]["active"] == 1 and frame["feeds"][0]["slots_in_use"] > 0, frame
    assert plain.returncode == 0, plain.stderr
    rows = {line.split()[0]: line for line in plain.stdout.splitlines() if line.split()}
    assert "input-bound" in rows[waiting] and " fed " in rows[computing], plain.stdout


# --- the live view, in tmux ---------------------------------------------------------------------------


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[list[str]]:
    """``tmux`` on a server of this test's own (``-L``), killed afterwards whatever happened."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup installs it where it may use apt-get)")
    command = ["tmux", "-L", f"dataferry-top-{tmp_path.name}", "-f", "/dev/null"]
    try:
        yield command
    finally:
        subprocess.run([*command, "kill-server"], capture_output=True, check=False, timeout=30)


def start_top(tmux: list[str], endpoint: str, exit_file: Path, *args: str) -> None:
    """``loader-service top`` in a detached 160x50 tmux session named ``top``; its exit code goes to
    ``exit_file`` when it ends (and the session with it)."""
    command = shlex.join([sys.executable, "-m", "loader_service", "top", "--endpoint", endpoint, *args])
    shell = f"cd {shlex.quote(str(REPO))} && {command}; echo $? > {shlex.quote(str(exit_file))}"
    size = ["-x", "160", "-y", "50"]  # and no COLUMNS or LINES from pytest, which rich would follow
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", *size, shell], check=True, env=env)


def screen(tmux: list[str]) -> str:
    command = [*tmux, "capture-pane", "-p", "-t", "top"]
    shown = subprocess.run(command, capture_output=True, text=True, check=False)
    return shown.stdout if shown.returncode == 0 else ""


def showing(tmux: list[str], pattern: str, seconds: float = 30) -> str:
    """The pane once it matches ``pattern`` (a line); fails with what it showed last."""
    regex = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + seconds
    while not regex.search(shown := screen(tmux)):
        assert time.monotonic() < deadline, f"the pane never showed {pattern!r}; last:\n{shown}"
        time.sleep(0.1)
    return shown


def quits_on_q(tmux: list[str], exit_file: Path) -> None:
    subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
    until(exit_file.exists, 5, "top exited on q")
    ended = subprocess.run([*tmux, "has-session", "-t", "top"], capture_output=True, check=False)
    assert ended.returncode != 0, "the tmux session outlived top"
    assert exit_file.read_text().strip() == "0"


def test_top_in_tmux_shows_the_trainers_and_quits_on_q(
    photos: Path, start_service: ServiceFactory, tmux: list[str], tmp_path: Path
) -> None:
    service = start_service(photos, workers=1, batch_size=8, heartbeat_interval=HEARTBEAT)
    exit_file = tmp_path / "exit"
    with trainer(service.endpoint, 0.05) as name:
        start_top(tmux, service.endpoint, exit_file)
        shown = showing(tmux, rf"^\s*{name}\s.*\d+%\s+(fed|somewhat input-bound|input-bound)\s")
        assert "loader-service top" in shown and "q quits" in shown and "Traceback" not in shown
        showing(tmux, rf"^\s*{name}\s.*(fed|input-bound)\s+\d", 10)  # its rates, from the second frame
        quits_on_q(tmux, exit_file)


def test_a_lost_service_is_said_in_the_frame_and_found_again(
    photos: Path, start_service: ServiceFactory, tmux: list[str], tmp_path: Path
) -> None:
    """The service stops: the frame says so and top keeps asking; it comes back: top shows it."""
    service = start_service(photos, workers=1, batch_size=8)
    exit_file = tmp_path / "exit"
    start_top(tmux, service.endpoint, exit_file, "--timeout", "1")
    showing(tmux, r"loader-service top .* up [\d.]+ s")
    assert service.stop() == 0
    lost = " ".join(showing(tmux, r"service lost: no status reply from").split())  # lines may wrap
    assert "within 1 s" in lost and "still trying" in lost and "Traceback" not in lost, lost
    assert not exit_file.exists()
    again = start_service(photos, workers=1, batch_size=8, endpoint=service.endpoint)
    back = until(lambda: "service lost" not in (shown := screen(tmux)) and shown, 30, "top found it again")
    assert re.search(r"loader-service top .* up [\d.]+ s  0 trainer", back), back
    assert again.proc.poll() is None
    quits_on_q(tmux, exit_file)
