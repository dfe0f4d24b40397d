"""The service run the way systemd runs it: a real NOTIFY_SOCKET, a watchdog interval, SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import ServiceProcess, left_behind, our_segments

pytestmark = pytest.mark.e2e


def test_ready_status_watchdog_stopping_and_clean_exit(photos: Path, tmp_path: Path) -> None:
    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(30)
    endpoint = f"ipc://{tmp_path}/feed.sock"
    before = our_segments()
    service = ServiceProcess(
        ["serve", "--data", str(photos), "--endpoint", endpoint, "--workers", "1", "--image-size", "32"],
        endpoint,
        # WATCHDOG_PID is what systemd sets for the main process; the interval is 1 s, pings at 0.5 s.
        env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": ""},
    )
    try:
        messages: list[str] = []

        def until(predicate: str) -> None:
            while not any(predicate in m for m in messages):
                messages.append(listener.recv(4096).decode())

        until("READY=1")
        assert service.proc.poll() is None
        service.wait_for(" ready: ", timeout=5)  # READY=1 comes after the ready line is logged
        started = time.monotonic()
        pings = 0
        while pings < 4:
            message = listener.recv(4096).decode()
            messages.append(message)
            pings += message == "WATCHDOG=1"
        assert time.monotonic() - started < 4, "pings at half the watchdog interval"
        until("STATUS=")
        status_line = next(m for m in messages if m.startswith("STATUS="))
        assert "trainers" in status_line and "img/s" in status_line
        service.proc.send_signal(signal.SIGTERM)
        until("STOPPING=1")
        assert service.proc.wait(20) == 0
    finally:
        service.kill_group()
        listener.close()
    assert not left_behind(before)  # other processes' segments may come and go meanwhile
    assert not os.path.exists(endpoint[len("ipc://") :])
