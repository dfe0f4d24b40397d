"""Names a peer or a dataset chose, as a person and Prometheus read them from a real service (issue
45): the status table, ``top`` and the service's log show them as text (NOTE [ Chosen names are
shown as text ]), ``top`` draws a name that reads as rich markup, a status with every session's
name at its longest is still answered (NOTE [ A status fits one frame ]), and the metrics label a
trainer by its name, never by its session (NOTE [ Trainer series ])."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from gpu_worker import ServiceLoader
from protocol.codec import decode, encode
from protocol.messages import Bye, ErrorReply, Hello, Welcome
from tests.helpers import REPO, ServiceFactory, epoch_indices, free_port, status, wait_until

pytestmark = pytest.mark.integration

OSC_52 = "\x1b]52;c;cHduZWQ=\x07"
"""Write "pwned" to the terminal's clipboard."""
OSC_0 = "\x1b]0;owned\x07"
"""Set the terminal window's title."""
RAW = ("\x1b", "\x07", "\x9b", "\u202e")
"""What must never reach a terminal: ESC, BEL, a one-character CSI, a right-to-left override."""
LONGEST = 128
"""``Hello.client``'s most characters (its group's: 64)."""


def loader_service(*args: str) -> subprocess.CompletedProcess[str]:
    """A ``loader-service`` command's run; ``top`` draws 200 columns, so no name is cut short."""
    command = [sys.executable, "-m", "loader_service", *args]
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)


@contextmanager
def sessions(endpoint: str, hellos: list[Hello]) -> Iterator[None]:
    """A session for each hello, opened by hand (no heartbeats: the service's --client-timeout is
    long), for the ``with`` body; each says bye after it, and the sockets are closed whatever
    happens."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        socks = []
        for hello in hellos:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(encode(hello))
            socks.append(sock)
        tokens = []
        for sock in socks:
            assert sock.poll(30_000), "no welcome"
            reply = decode(sock.recv(), (Welcome, ErrorReply))
            assert isinstance(reply, Welcome), reply
            tokens.append(reply.token)
        yield
        for sock, token in zip(socks, tokens, strict=True):
            sock.send(encode(Bye(token)))
    finally:
        ctx.destroy(linger=1000)


def assert_text(shown: str, where: str) -> None:
    for raw in RAW:
        assert raw not in shown, f"{raw!r} reached {where}:\n{shown!r}"


@pytest.fixture
def hostile_data(photos: Path, tmp_path: Path) -> Path:
    """The photos, and a file that is no image whose name holds a title escape."""
    root = tmp_path / "data"
    shutil.copytree(photos, root)
    first = sorted(p for p in root.iterdir() if p.is_dir())[0]
    (first / f"bad{OSC_0}\u202e.jpg").write_bytes(b"not a jpeg")
    return root


def test_status_top_and_the_log_show_chosen_names_as_text(
    hostile_data: Path, start_service: ServiceFactory
) -> None:
    """A broadcast group named with an OSC 52 sequence, a trainer named ``[/]`` (rich markup that
    closes nothing) and one with a title escape and a C1 CSI, a bad file whose name holds ESC: each
    shows as its escapes, and ``top`` draws ``[/]`` as it is. Before, status and the log wrote them
    raw (a terminal took the clipboard write and the title) and ``top`` exited with a traceback."""
    service = start_service(hostile_data, client_timeout=120)
    with ServiceLoader(service.endpoint, timeout=30) as trainer:
        epoch_indices(trainer)
    wait_until(lambda: status(service.endpoint)["feeds"][0]["bad_files"] >= 1, "the bad file was counted")
    hellos = [
        Hello("[/]", 1),
        Hello(f"evil{OSC_0}\x9b31m", 2),
        Hello("member", 3, mode="broadcast", group=OSC_52, group_size=2),
    ]
    with sessions(service.endpoint, hellos):
        table = loader_service("status", "--endpoint", service.endpoint)
        drawn = loader_service("top", "--once", "--endpoint", service.endpoint)
        framed = loader_service("top", "--once", "--json", "--endpoint", service.endpoint)
    assert table.returncode == 0, table.stderr
    assert_text(table.stdout, "loader-service status")
    assert "\\x1b]52;c;cHduZWQ=\\x07" in table.stdout, table.stdout  # the group
    assert "evil\\x1b]0;owned\\x07\\x9b31m" in table.stdout, table.stdout  # a trainer
    assert "bad\\x1b]0;owned\\x07\\u202e.jpg" in table.stdout, table.stdout  # a bad file
    assert drawn.returncode == 0 and "Traceback" not in drawn.stderr, drawn.stderr
    assert_text(drawn.stdout, "loader-service top")
    assert "[/]" in drawn.stdout and "evil\\x1b]0;owned" in drawn.stdout, drawn.stdout
    assert framed.returncode == 0, framed.stderr
    clients = {t["client"] for t in json.loads(framed.stdout)["trainers"]}
    assert {"[/]", "evil\\x1b]0;owned\\x07\\x9b31m", "member"} <= clients, "the service escapes them"
    service.wait_for(r"bad sample skipped: .*bad\\x1b\]0;owned\\x07\\u202e\.jpg")
    service.wait_for(r"trainer evil\\x1b\]0;owned\\x07\\x9b31m \(pid 2\) attached")
    assert_text(service.log, "the service's log")


def test_a_status_of_a_hundred_sessions_with_the_longest_names_is_answered(
    photos: Path, start_service: ServiceFactory
) -> None:
    """A hundred broadcast sessions, each client name 128 four-byte characters and each group 64:
    the status would be about 100 KB, over a frame's 64 KiB, and before it was never sent (status
    and top timed out). Now it lists the sessions that fit and says how many it left out."""
    service = start_service(photos, client_timeout=120)
    hellos = [
        Hello(f"{i:03d}" + "\U0001f642" * (LONGEST - 3), i + 1, mode="broadcast",
              group=f"{i:03d}" + "\U0001f642" * 61)
        for i in range(100)
    ]  # fmt: skip
    with sessions(service.endpoint, hellos):
        shown = loader_service("status", "--json", "--endpoint", service.endpoint, "--timeout", "10")
        table = loader_service("status", "--endpoint", service.endpoint, "--timeout", "10")
        framed = loader_service("top", "--once", "--json", "--endpoint", service.endpoint, "--timeout", "10")
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    listed = len(body["sessions"])
    assert body["attached"] == 100 and listed + body["sessions_left_out"] == 100, body["sessions_left_out"]
    assert listed >= 40, f"only {listed} of 100 sessions fit"
    assert table.returncode == 0, table.stderr
    assert f"{100 - listed} more trainer(s) not listed" in table.stdout, table.stdout[-2000:]
    assert framed.returncode == 0, framed.stderr
    frame = json.loads(framed.stdout)
    assert len(frame["trainers"]) == listed and frame["trainers_left_out"] == 100 - listed


def trainer_series(port: int, attached: int) -> set[str] | None:
    """The per-trainer series (name and labels) of the service's /metrics page once it shows
    ``attached`` sessions (one page is one snapshot: every such session is in it); else None."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    if f"dataferry_trainers_attached {attached:.1f}" not in lines:
        return None
    return {line.rsplit(" ", 1)[0] for line in lines if line.startswith("dataferry_trainer_")}


def test_trainers_that_come_and_go_leave_a_bounded_set_of_series(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Five rounds of 20 sessions of one trainer (one client name), each session new: before, each
    had series of its own (80 a round, 400 in all for Prometheus to keep); now the trainer's five
    (lag, credits, leased, demand, encode share), and none once it has left."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, client_timeout=120, metrics_port=port)
    seen: set[str] = set()
    for _ in range(5):
        with sessions(service.endpoint, [Hello("host:7", 7) for _ in range(20)]):
            seen |= until(lambda: trainer_series(port, 20), "the round's sessions in the metrics")
        assert until(lambda: trainer_series(port, 0), "the round's sessions gone") == set()
    assert len(seen) == 5, sorted(seen)
    assert all('{client="host:7",feed="train"}' in series for series in seen), seen


def until(probe: Callable[[], set[str] | None], what: str, seconds: float = 30) -> set[str]:
    deadline = time.monotonic() + seconds
    while (found := probe()) is None:
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)
    return found
