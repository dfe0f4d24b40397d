"""sd_notify and the watchdog (``loader_service.supervisor.edges.systemd``) on real datagram sockets."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from loader_service.supervisor.edges import systemd


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound in tmp_path, named by ``$NOTIFY_SOCKET`` as systemd does."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_an_inherited_notify_fd_gets_every_line_and_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ A private service ]: readiness on a socket pair only the parent holds; a parent that
    stopped reading never blocks the service (the sends do not wait)."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        monkeypatch.setenv("DATAFERRY_NOTIFY_FD", str(theirs.fileno()))
        assert systemd.ready("up") is True
        assert ours.recv(4096) == b"READY=1\nSTATUS=up"
        assert not os.get_inheritable(theirs.fileno()), "the decode workers do not inherit it"
        sent = [systemd.status("x" * 1000) for _ in range(10_000)]  # far more than the buffer holds
        assert sent[0] and not sent[-1], "a full channel refuses at once instead of waiting"
        ours.close()
        assert systemd.stopping() is False, "a parent gone is no error"


def test_notify_without_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.ready("up") is False and systemd.status("x") is False and systemd.stopping() is False


def test_ready_status_and_stopping_send_one_datagram_each(notify_socket: socket.socket) -> None:
    assert systemd.ready("serving 'train'") is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving 'train'"
    assert systemd.status("2 trainers\nattached") is True
    assert notify_socket.recv(4096) == b"STATUS=2 trainers attached"
    assert systemd.stopping() is True
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_notify_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"dataferry-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready() is True
        assert sock.recv(4096) == b"READY=1"


def test_notify_to_a_missing_socket_fails_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert systemd.notify("READY=1") is False


def test_watchdog_pings_at_half_the_interval(notify_socket: socket.socket) -> None:
    watchdog = systemd.Watchdog({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert watchdog.enabled and watchdog.interval == 2.0
    assert watchdog.due(100.0)  # the first ping is due at once
    assert watchdog.ping(100.0) is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert not watchdog.due(101.9)
    assert watchdog.due(102.0)
    watchdog.ping(102.0)
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert not watchdog.due(103.0)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "soon"},
        {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"},
    ],
)
def test_watchdog_is_off_unless_it_is_meant_for_this_process(environ: Mapping[str, str]) -> None:
    if environ.get("WATCHDOG_PID") == str(os.getpid()):
        pytest.skip("this test runs as pid 1")
    watchdog = systemd.Watchdog(environ)
    assert not watchdog.enabled and watchdog.interval is None
    assert not watchdog.due(0.0) and not watchdog.due(1e9)


def test_watchdog_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.Watchdog().interval == 15.0
