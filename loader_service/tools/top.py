"""``loader-service top``: a live view of a running service, a frame a second (issue 39).

A frame is built from two status snapshots (``LoaderService.status``) taken about a second apart:
rates are the growth of the service's counters between them, so ``--once`` asks twice too. Each
trainer's wait share is its demand's (NOTE [ Input-bound verdict ], over the service's last 10 s),
judged by ``protocol.verdict``. Building a frame and drawing it are pure (``build_frame``,
``lost_frame``, ``render``); the rest talks to the service and the terminal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import zmq
from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from curvekeys import ClientKeys
from loader_service.tools.status_view import SLOT_STATES, _duration, _endpoint_hint, _records
from protocol.codec import decode, encode
from protocol.messages import ErrorReply, Heartbeat, ProtocolError, StatusReply, StatusRequest
from protocol.verdict import share_from_demand, verdict

REFRESH = 1.0
STORE_FIELDS = (("retries", "store_waits"), ("bad_files", "bad_files"))  # a store's errors end as bad files
"""Seconds between frames, and between ``--once``'s two snapshots."""
QUIT_KEYS = b"qQ\x03"
"""Keys that quit (Ctrl-C too, should the terminal pass it on as a key)."""
VERDICT_STYLES = {"fed": "green", "somewhat input-bound": "yellow", "input-bound": "bold red"}
TRAINER_COLUMNS = "TRAINER CLIENT FEED >WAIT VERDICT >BATCHES/S >IMAGES/S >LAG"
FEED_COLUMNS = "FEED >IMAGES/S SLOTS >BAD_FILES SAMPLE_CACHE"
"""Column titles: ``_`` stands for a space, ``>`` aligns right."""
NO_WRAP = {"TRAINER", "FEED", "VERDICT"}
Sample = tuple[float, Mapping[str, Any]]
"""(``time.monotonic()`` when it came, the status body)."""
Frame = dict[str, Any]

# --- a frame from two snapshots (pure) ------------------------------------------------------------


def build_frame(endpoint: str, now: Sample, before: Sample | None) -> Frame:
    """What one frame shows, JSON-shaped; rates ``None`` without an earlier snapshot to compare."""
    body = now[1]
    seconds = now[0] - before[0] if before is not None else 0.0
    old = before[1] if before is not None and seconds > 0 else {}
    feeds = _records(body, "feeds")
    rows = {f.get("name"): _rows_per_batch(f) for f in feeds}
    old_sessions = {s.get("session"): s for s in _records(old, "sessions")}
    old_feeds = {f.get("name"): f for f in _records(old, "feeds")}
    trainers = [
        _trainer(s, old_sessions.get(s.get("session")), rows.get(s.get("feed")), seconds)
        for s in _records(body, "sessions")
    ]
    store = {key: sum(_count(f.get(field)) for f in feeds) for key, field in STORE_FIELDS}
    return {
        "endpoint": endpoint, "lost": None, "uptime_s": _number(body.get("uptime")),
        "interval_s": round(seconds, 3) if old else None, "trainers": trainers, "workers": _workers(body),
        "feeds": [_feed(f, old_feeds.get(f.get("name")), seconds) for f in feeds], "store": store,
    }  # fmt: skip


def lost_frame(endpoint: str, why: str, last: Frame | None) -> Frame:
    """The last frame (or an empty one) marked lost: ``why`` no snapshot came."""
    empty: Frame = {"uptime_s": None, "interval_s": None, "trainers": [], "feeds": [], "workers": {}}
    return {**(last or empty), "endpoint": endpoint, "lost": why}


def _trainer(s: Mapping[str, Any], old: Mapping[str, Any] | None, rows: float | None,
             seconds: float) -> dict[str, Any]:  # fmt: skip
    demand = _number(s.get("demand"))
    share = share_from_demand(demand) if demand is not None else 0.0
    batches = _rate(s.get("delivered"), None if old is None else old.get("delivered"), seconds)
    return {
        "session": s.get("session"), "client": s.get("client"), "feed": s.get("feed"),
        "wait_share": round(share, 3), "verdict": verdict(share), "demand": demand, "batches_per_s": batches,
        "images_per_s": None if batches is None or rows is None else round(batches * rows, 1),
        "delivered": s.get("delivered"), "lag": s.get("lag"), "idle_s": _number(s.get("idle_seconds")),
    }  # fmt: skip


def _rows_per_batch(feed: Mapping[str, Any]) -> float | None:
    """The feed's mean rows a batch (images decoded over batches made): the status has no batch size."""
    decoded, batches = _number(feed.get("decoded")), _number(feed.get("batches"))
    return decoded / batches if decoded is not None and batches else None


def _feed(f: Mapping[str, Any], old: Mapping[str, Any] | None, seconds: float) -> dict[str, Any]:
    """Images/s over the interval (without one, the service's over its last 10 s)."""
    counts = {state: _count(_map(f.get("slots")).get(state)) for state in SLOT_STATES}
    rate = _rate(f.get("decoded"), _map(old).get("decoded"), seconds)
    return {
        "name": f.get("name"), "images_per_s": _number(f.get("images_per_second")) if rate is None else rate,
        "slots": counts, "slots_in_use": counts["filling"] + counts["ready"] + counts["leased"],
        "slots_most": f.get("slots_most"), "bad_files": f.get("bad_files"),
        "cache": _cache(f.get("cache"), None if old is None else old.get("cache")),
    }  # fmt: skip


def _cache(cache: object, old: object) -> dict[str, Any] | None:
    """Hit rates since the start and over the last interval (``None``: nothing looked up)."""
    if not isinstance(cache, Mapping):
        return None
    hits, misses = _count(cache.get("hits")), _count(cache.get("misses"))
    new_hits, new_misses = hits - _count(_map(old).get("hits")), misses - _count(_map(old).get("misses"))
    recent = _share(new_hits, new_hits + new_misses) if isinstance(old, Mapping) else None
    return {
        "kind": cache.get("kind"), "hits": hits, "misses": misses, "full": bool(cache.get("full")),
        "hit_rate": _share(hits, hits + misses), "recent_hit_rate": recent,
    }  # fmt: skip


def _workers(body: Mapping[str, Any]) -> dict[str, Any]:
    sizing, load = _map(body.get("sizing")), _map(body.get("load"))
    active, started = _count(sizing.get("active")), _count(sizing.get("started"))
    decisions = sizing.get("decisions")
    last = decisions[-1] if isinstance(decisions, list) and decisions else None
    return {
        "mode": sizing.get("mode"), "active": active, "started": started, "most": sizing.get("most"),
        "parked": max(0, started - active), "budget": sizing.get("budget"), "busy": _number(load.get("busy")),
        "demand": _number(load.get("demand")), "load": _number(load.get("load")),
        "restarts": body.get("worker_restarts"),
        "last_decision": dict(last) if isinstance(last, Mapping) else None,
    }  # fmt: skip


def _rate(now: object, before: object, seconds: float) -> float | None:
    """Growth a second; ``None`` without both counts or if it went back (a new session, service)."""
    a, b = _number(now), _number(before)
    if a is None or b is None or seconds <= 0 or a < b:
        return None
    return round((a - b) / seconds, 2)


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


# --- drawing a frame (pure) -------------------------------------------------------------------------


def render(frame: Frame, hint: str = "") -> RenderableType:
    """The frame as rich renderables: a header (ending in ``hint``), trainers, feeds, workers, the store."""
    bad = _map(frame.get("store")).get("bad_files")
    store = f"store: {_cell(_map(frame.get('store')).get('retries'))} retries; {_cell(bad)} bad file(s)"
    return Group(_header(frame, hint), _trainer_table(frame["trainers"]), _feed_table(frame["feeds"]),
                 _worker_lines(frame["workers"]), Text(store if bad is not None else ""))  # fmt: skip


def _header(frame: Frame, hint: str) -> Text:
    text = Text.assemble(("loader-service top ", "bold"), frame["endpoint"])
    text.append(f"  up {_duration(frame['uptime_s'])}  {len(frame['trainers'])} trainer(s)  {hint}")
    if frame["lost"]:
        text.append(f"\nservice lost: {frame['lost']}; still trying", style="bold red")
    return text


def _trainer_table(trainers: list[dict[str, Any]]) -> RenderableType:
    if not trainers:
        return Text("no trainers attached")
    table = _table("trainers (wait: share of the step, last 10 s)", TRAINER_COLUMNS)
    for t in trainers:
        table.add_row(
            _cell(t["session"]), _cell(t["client"]), _cell(t["feed"]), f"{100 * t['wait_share']:.0f}%",
            Text(t["verdict"], style=VERDICT_STYLES.get(t["verdict"], "")),
            _cell(t["batches_per_s"]), _cell(t["images_per_s"]), _cell(t["lag"]),
        )  # fmt: skip
    return table


def _feed_table(feeds: list[dict[str, Any]]) -> RenderableType:
    if not feeds:
        return Text("no feeds reported")
    table = _table("feeds", FEED_COLUMNS)
    for f in feeds:
        states = ", ".join(f"{f['slots'][state]} {state}" for state in SLOT_STATES)
        slots = f"{f['slots_in_use']} used of {_cell(f['slots_most'])}: {states}"
        table.add_row(_cell(f["name"]), _cell(f["images_per_s"]), slots, _cell(f["bad_files"]),
                      _cache_cell(f["cache"]))  # fmt: skip
    return table


def _table(title: str, columns: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")
    for column in columns.split():
        justify: JustifyMethod = "right" if column.startswith(">") else "left"
        table.add_column(column.lstrip(">").replace("_", " "), justify=justify, no_wrap=column in NO_WRAP)
    return table


def _cache_cell(cache: dict[str, Any] | None) -> str:
    if cache is None:
        return "none"
    last = "" if cache["recent_hit_rate"] is None else f", last second {_percent(cache['recent_hit_rate'])}"
    return f"{cache['kind']}: {_percent(cache['hit_rate'])} hits{last}{' (full)' if cache['full'] else ''}"


def _worker_lines(w: dict[str, Any]) -> Text:
    if not w:
        return Text("")
    mode = "--workers" if w["mode"] != "auto" else f"auto, up to {_cell(w['most'])}"
    text = Text(
        f"workers: {_cell(w['active'])} active, {_cell(w['parked'])} parked ({mode}); "
        f"busy {_percent(w['busy'])}, trainers' demand "
        f"{_cell(w['demand'])}, load {_cell(w['load'])}, {_cell(w['restarts'])} restart(s)"
    )
    last = w["last_decision"]
    if last:
        text.append(f"\nsizing: {_cell(last.get('from'))} -> {_cell(last.get('to'))} "
                    f"{_duration(last.get('seconds_ago'))} ago: {last.get('reason')}")  # fmt: skip
    return text


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return "-" if value is None else str(value)


# --- the service and the terminal -------------------------------------------------------------------


class StatusLink:
    """One DEALER to the service, kept between snapshots; made anew after a lost answer."""

    def __init__(self, endpoint: str, server_key: str | None, client_key: str | None) -> None:
        self.endpoint = endpoint
        self._keys = ClientKeys.load(server_key, client_key)  # ValueError naming a bad file
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.apply(sock)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # a malformed endpoint: nothing to keep
            self.close()
            raise ValueError(f"invalid endpoint {self.endpoint!r}: {exc}") from None
        return sock

    def ask(self) -> None:
        self.sock.send(encode(StatusRequest()), zmq.NOBLOCK)

    def take(self) -> Mapping[str, Any] | None:
        """The newest status body waiting, if any; ``RuntimeError`` if the service refused."""
        body = None
        while self.sock.poll(0):
            try:
                msg = decode(self.sock.recv_multipart()[-1], (StatusReply, Heartbeat, ErrorReply))
            except ProtocolError:
                continue
            if isinstance(msg, ErrorReply):
                raise RuntimeError(f"the service at {self.endpoint} refused the request: {msg.message}")
            if isinstance(msg, StatusReply):
                body = msg.body
        return body

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def snapshot(link: StatusLink, timeout: float, fd: int | None = None) -> Sample:
    """Ask and wait; ``TimeoutError`` (the link made anew) if no answer comes within ``timeout``."""
    link.ask()
    body = wait(link, fd, time.monotonic() + timeout, reply=True)
    if body is not None:
        return time.monotonic(), body
    link.sock.close()  # a new connection: no stale request is answered later
    link.sock = link._connect()
    hint = _endpoint_hint(link.endpoint)
    raise TimeoutError(f"no status reply from {link.endpoint} within {timeout:g} s{hint}")


def wait(link: StatusLink, fd: int | None, until: float, reply: bool) -> Mapping[str, Any] | None:
    """Until ``until`` or, if ``reply``, a status body; ``KeyboardInterrupt`` on q read from ``fd``."""
    while (left := until - time.monotonic()) > 0:
        ready = zmq.select([link.sock, *([] if fd is None else [fd])], [], [], left)[0]
        if fd is not None and fd in ready and _quits(fd):
            raise KeyboardInterrupt
        if link.sock in ready and (body := link.take()) is not None and reply:
            return body
    return None


def _quits(fd: int) -> bool:
    try:
        keys = os.read(fd, 64)
    except OSError:  # EIO: the terminal went away, as does an end of file
        return True
    return not keys or any(key in QUIT_KEYS for key in keys)


@contextmanager
def keys_pressed() -> Iterator[int | None]:
    """stdin's descriptor in cbreak mode (keys come one by one, unechoed) for the ``with`` body, its
    settings restored after it whatever happens; ``None`` if stdin is no terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    fd, saved = sys.stdin.fileno(), termios.tcgetattr(sys.stdin.fileno())
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def watch(link: StatusLink, timeout: float, show: Callable[[Frame], None], fd: int | None) -> None:
    """A frame a second until q (``KeyboardInterrupt``); a lost service is shown so and asked again."""
    before: Sample | None = None
    frame: Frame | None = None
    while True:
        started = time.monotonic()
        try:
            now = snapshot(link, timeout, fd)
            frame = build_frame(link.endpoint, now, before)
            before = now
        except (TimeoutError, RuntimeError) as exc:
            frame = lost_frame(link.endpoint, str(exc), frame)
        show(frame)
        wait(link, fd, started + REFRESH, reply=False)


def _console() -> Console:  # 120 columns rather than 80 when printing to no terminal (COLUMNS unset)
    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)


def _live(link: StatusLink, timeout: float) -> None:
    console = _console()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the terminal's settings are restored
        signal.signal(sig, signal.default_int_handler)
    if not console.is_terminal:  # piped: one frame after another, as `top -b` does
        watch(link, timeout, lambda frame: console.print(render(frame), "\n"), None)
        return
    with keys_pressed() as fd, Live(console=console, auto_refresh=False, screen=True) as live:
        watch(link, timeout, lambda frame: live.update(render(frame, "q quits"), refresh=True), fd)


def _once(link: StatusLink, timeout: float, as_json: bool) -> None:
    first = snapshot(link, timeout)
    time.sleep(max(0.0, REFRESH - (time.monotonic() - first[0])))
    frame = build_frame(link.endpoint, snapshot(link, timeout), first)
    if as_json:
        print(json.dumps(frame, indent=2, sort_keys=True))
    else:
        _console().print(render(frame))


def main_top(endpoint: str, once: bool, as_json: bool, timeout: float,
             server_key: str | None = None, client_key: str | None = None) -> int:  # fmt: skip
    """``loader-service top``: 0 on q or Ctrl-C or after ``--once``'s frame; 1 (why on stderr) for a bad
    endpoint or key, or no answer to ``--once``; 130 if ``--once`` is interrupted."""
    try:
        link = StatusLink(endpoint, server_key, client_key)
    except ValueError as exc:
        print(f"loader-service top: {exc}", file=sys.stderr)
        return 1
    try:
        if once:
            _once(link, timeout, as_json)
        else:
            _live(link, timeout)
    except (TimeoutError, RuntimeError) as exc:
        print(f"loader-service top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130 if once else 0
    finally:
        link.close()
    return 0
