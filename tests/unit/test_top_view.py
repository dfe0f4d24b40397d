"""``loader-service top``'s frame (issue 39): built from two status snapshots and drawn, without a
service; and its terminal handling on a pseudo-terminal."""

from __future__ import annotations

import io
import json
import math
import os
import pty
import sys
import termios
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from loader_service.tools.cli import main
from loader_service.tools.top import build_frame, lost_frame, render
from loader_service.tools.top_live import StatusLink, keys_pressed, wait
from protocol.verdict import share_from_demand, verdict

ENDPOINT = "ipc:///tmp/nowhere.sock"


def session(name: str, demand: object, delivered: int) -> dict[str, Any]:
    return {"session": name, "client": "host:1", "feed": "train", "demand": demand, "delivered": delivered,
            "lag": 0, "idle_seconds": 0.1}  # fmt: skip


def body(delivered: tuple[int, int], decoded: int, hits: int = 0, misses: int = 0) -> dict[str, Any]:
    """A status body as ``LoaderService.status`` gives it: trainer t1 waits, t2 computes."""
    cache = {"kind": "decoded", "hits": hits, "misses": misses, "full": False}
    slots = {"free": 2, "filling": 1, "ready": 3, "leased": 4}
    return {
        "uptime": 61.0,
        "sessions": [session("t1", 10.0, delivered[0]), session("t2", 1.0, delivered[1])],
        "feeds": [{"name": "train", "decoded": decoded, "batches": decoded // 8, "images_per_second": 99.0,
                   "slots": slots, "slots_most": 64, "bad_files": 2, "store_waits": 3, "cache": cache}],
        "sizing": {"mode": "auto", "active": 3, "started": 5, "most": 8, "budget": 2.0,
                   "decisions": [{"seconds_ago": 4.0, "from": 2, "to": 3, "reason": "trainers waited"}]},
        "load": {"busy": 0.5, "demand": 5.5, "load": 2.75},
        "worker_restarts": 1,
    }  # fmt: skip


def two_frames() -> dict[str, Any]:
    return build_frame(ENDPOINT, (12.0, body((140, 25), 2000, 30, 10)), (10.0, body((100, 15), 1200, 10, 10)))


def test_each_trainer_has_its_wait_share_verdict_and_rates() -> None:
    frame = two_frames()
    waiting, computing = frame["trainers"]
    assert (waiting["wait_share"], waiting["verdict"]) == (0.9, "input-bound")
    assert (computing["wait_share"], computing["verdict"]) == (0.0, "fed")
    assert waiting["batches_per_s"] == 20.0 and computing["batches_per_s"] == 5.0  # 40 and 10 in 2 s
    assert waiting["images_per_s"] == 160.0, "batches/s times the feed's rows a batch (decoded / batches)"
    assert frame["interval_s"] == 2.0


@pytest.mark.parametrize(
    "demand", [0.0, 1.0, 1.05, 1.0526, 1.06, 1.25, 1.26, 3.0, 10.0, 1e9, -1.0, "x", None]
)
def test_the_verdict_is_protocol_verdicts_and_the_share_a_fraction(demand: object) -> None:
    """NOTE [ Input-bound verdict ]: the one rule, from the demand the status reports."""
    frame = build_frame(ENDPOINT, (1.0, {"sessions": [session("t1", demand, 5)]}), None)
    trainer = frame["trainers"][0]
    assert 0.0 <= trainer["wait_share"] <= 1.0
    share = share_from_demand(demand) if isinstance(demand, float) else 0.0
    assert trainer["verdict"] == verdict(share)
    assert trainer["wait_share"] == pytest.approx(share, abs=1e-3)


def test_without_an_earlier_snapshot_rates_are_unknown_not_zero() -> None:
    frame = build_frame(ENDPOINT, (5.0, body((10, 10), 100)), None)
    assert all(t["batches_per_s"] is None and t["images_per_s"] is None for t in frame["trainers"])
    assert frame["feeds"][0]["images_per_s"] == 99.0, "the service's own rate over its last 10 s"
    assert frame["interval_s"] is None


def test_a_new_session_or_a_restarted_service_has_no_rate() -> None:
    before = body((100, 15), 1200)
    before["sessions"] = before["sessions"][:1]  # t2 attached since
    now = body((3, 25), 1300)  # t1's count went back: a new session under the same name
    frame = build_frame(ENDPOINT, (2.0, now), (1.0, before))
    assert [t["batches_per_s"] for t in frame["trainers"]] == [None, None]


def test_feeds_workers_cache_and_store() -> None:
    frame = two_frames()
    feed = frame["feeds"][0]
    assert feed["images_per_s"] == 400.0 and feed["slots_in_use"] == 8 and feed["slots_most"] == 64
    assert feed["cache"]["hit_rate"] == 0.75 and feed["cache"]["recent_hit_rate"] == 1.0  # 20 hits, 0 misses
    workers = frame["workers"]
    assert (workers["active"], workers["parked"], workers["busy"]) == (3, 2, 0.5)
    assert workers["last_decision"]["reason"] == "trainers waited"
    assert frame["store"] == {"retries": 3, "bad_files": 2}


def test_a_body_missing_every_field_still_makes_a_frame() -> None:
    frame = build_frame(ENDPOINT, (2.0, {}), (1.0, {"feeds": "junk", "sessions": [3]}))
    assert frame["trainers"] == [] and frame["feeds"] == []
    assert frame["workers"]["active"] == 0
    text = drawn(frame)
    assert "no trainers attached" in text and "no feeds reported" in text


def drawn(frame: dict[str, Any], hint: str = "") -> str:
    console = Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(frame, hint))
    console.file.close()
    return console.export_text()


def test_the_drawn_frame_shows_what_the_issue_lists() -> None:
    text = drawn(two_frames(), "q quits")
    lines = {line.split()[0]: line for line in text.splitlines() if line.split()}
    assert "input-bound" in lines["t1"] and "90%" in lines["t1"] and " 20 " in lines["t1"]
    assert "fed" in lines["t2"] and "0%" in lines["t2"]
    assert "8 used of 64: 2 free, 1 filling, 3 ready, 4 leased" in text
    assert "decoded: 75% hits, last second 100%" in text
    assert "3 active, 2 parked (auto, up to 8); busy 50%" in text
    assert "sizing: 2 -> 3 4.0 s ago: trainers waited" in text
    assert "store: 3 retries; 2 bad file(s)" in text
    assert "up 1 min 01 s" in text and "q quits" in text


def test_a_lost_service_keeps_the_last_frame_and_says_so() -> None:
    last = two_frames()
    frame = lost_frame(ENDPOINT, "no status reply within 5 s", last)
    assert frame["lost"] == "no status reply within 5 s" and frame["trainers"] == last["trainers"]
    assert "service lost: no status reply within 5 s; still trying" in drawn(frame)
    first = lost_frame(ENDPOINT, "no status reply", None)
    assert "service lost" in drawn(first) and first["trainers"] == []


def test_the_frame_is_json() -> None:
    frame = two_frames()
    assert json.loads(json.dumps(frame)) == frame
    assert all(math.isfinite(t["wait_share"]) for t in frame["trainers"])


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """stdin on a pseudo-terminal; the master side's descriptor, to type on."""
    master, slave = pty.openpty()
    stdin = os.fdopen(slave, "r")
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        yield master
    finally:
        stdin.close()
        os.close(master)


def test_the_terminal_is_restored_even_on_an_error(terminal: int) -> None:
    before = termios.tcgetattr(sys.stdin.fileno())
    with pytest.raises(RuntimeError), keys_pressed() as fd:
        assert fd is not None and fd == sys.stdin.fileno()
        assert termios.tcgetattr(fd)[3] & termios.ICANON == 0, "cbreak: keys come one by one"
        raise RuntimeError("boom")
    assert termios.tcgetattr(sys.stdin.fileno()) == before


def test_q_stops_the_wait_at_once(terminal: int) -> None:
    link = StatusLink(ENDPOINT, None, None)
    try:
        with keys_pressed() as fd:
            assert wait(link, fd, time.monotonic() + 0.05, reply=False) is None  # nothing typed
            os.write(terminal, b"x")
            assert wait(link, fd, time.monotonic() + 0.05, reply=False) is None  # not a quitting key
            os.write(terminal, b"q")
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                wait(link, fd, started + 10, reply=False)
            assert time.monotonic() - started < 1
    finally:
        link.close()


def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--json", "--endpoint", ENDPOINT]) == 2
    assert "--json prints one frame" in capsys.readouterr().err
    assert main(["top", "--once", "--endpoint", ENDPOINT, "--timeout", "0.2"]) == 1
    assert "no status reply from ipc:///tmp/nowhere.sock within 0.2 s" in capsys.readouterr().err
    assert main(["top", "--once", "--endpoint", "nonsense"]) == 1
    assert "invalid endpoint 'nonsense'" in capsys.readouterr().err


def test_a_terminal_that_went_away_ends_the_view() -> None:
    """An ssh connection dropped without its SIGHUP reaching top: reading the terminal fails (EIO),
    which quits rather than spinning on a descriptor that is always readable."""
    master, slave = pty.openpty()
    link = StatusLink(ENDPOINT, None, None)
    try:
        os.close(master)
        with pytest.raises(KeyboardInterrupt):
            wait(link, slave, time.monotonic() + 10, reply=False)
    finally:
        link.close()
        os.close(slave)


def test_a_trainers_ledger_by_source_is_in_the_frame_and_drawn() -> None:
    """NOTE [ Source ledger ]: a trainer of a feed of several sources brings its rows by source."""
    ledger = [
        {"source": "photos", "served": 120, "share": 0.6, "asked": 0.6, "pass": 1, "position": 20},
        {"source": "extra", "served": 80, "share": 0.4, "asked": 0.4},
    ]
    now = body((140, 25), 2000)
    now["sessions"][0]["sources"] = ledger
    frame = build_frame(ENDPOINT, (2.0, now), None)
    assert frame["trainers"][0]["sources"] == ledger and frame["trainers"][1]["sources"] == []
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(frame))
    rows = [line.split() for line in console.export_text().splitlines()]
    assert ["t1", "photos", "120", "0.60", "0.60", "1", "20"] in rows
    assert ["t1", "extra", "80", "0.40", "0.40", "-", "-"] in rows
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(two_frames()))
    assert "sources (" not in console.export_text(), "a feed of one source: no ledger"


OSC_52 = "\x1b]52;c;cHduZWQ=\x07"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def test_chosen_names_are_drawn_as_text_never_as_markup_or_escapes() -> None:
    """NOTE [ Chosen names are shown as text ]: a trainer named ``[/]`` (markup that closes nothing:
    rich raised MarkupError and top exited), names holding escapes (a clipboard write, a title, a
    C1 CSI, a bidi override, a carriage return) in every place a frame draws one."""
    now = body((140, 25), 2000)
    now["sessions"][0].update(client="[/]", session="[bold]t1")
    now["sessions"][1].update(client=f"evil{OSC_52}\u202e", feed="f\x1b]0;title\x07")
    now["sessions"][0]["sources"] = [{"source": "s\x1b[2J", "served": 1}]
    now["feeds"][0]["name"] = "train\x9b31m"
    now["feeds"][0]["cache"]["kind"] = "[red]kind"
    now["sizing"]["decisions"][0]["reason"] = "why\r\x1b[K"
    frame = build_frame("ipc:///x\x1b[2J", (2.0, now), None)
    text = ""
    for shown in (frame, lost_frame(ENDPOINT, f"lost {OSC_52}", frame)):
        out = io.StringIO()
        Console(file=out, width=200, color_system=None).print(render(shown, "q quits"))
        text += out.getvalue()
    assert not [raw for raw in RAW if raw in text], text
    assert "[/]" in text and "[bold]t1" in text and "[red]kind" in text
    escapes = ("evil\\x1b]52;c;cHduZWQ=\\x07\\u202e", "f\\x1b]0;title\\x07", "s\\x1b[2J", "train\\x9b31m",
               "why\\r\\x1b[K", "ipc:///x\\x1b[2J", "lost \\x1b]52")  # fmt: skip
    for escaped in escapes:
        assert escaped in text, escaped


def test_trainers_the_status_left_out_are_counted_in_the_header() -> None:
    """NOTE [ A status fits one frame ]: the sessions the reply had no room for are said."""
    now = {**body((140, 25), 2000), "sessions_left_out": 37}
    frame = build_frame(ENDPOINT, (2.0, now), None)
    assert frame["trainers_left_out"] == 37
    assert "2 trainer(s) (37 more not listed)" in drawn(frame)
    assert "more not listed" not in drawn(two_frames())
