"""``loader-service top``: a live view of a running service, a frame a second (issue 39).

A frame is built from two status snapshots (``LoaderService.status``) taken about a second apart:
rates are the growth of the service's counters between them, so ``--once`` asks twice too. Each
trainer's wait share is its demand's (NOTE [ Input-bound verdict ], over the service's last 10 s),
judged by ``protocol.verdict``. Building a frame and drawing it are pure (``build_frame``,
``lost_frame``, ``render``); the rest talks to the service and the terminal. Every value is drawn
as text: shown so (NOTE [ Chosen names are shown as text ]) and never read as rich markup, so a
trainer named ``[/]`` is drawn as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from loader_service.tools.status_view import _duration, _records
from protocol.printable import printable
from protocol.status import SLOT_STATES
from protocol.verdict import share_from_demand, verdict

REFRESH = 1.0
STORE_FIELDS = (("retries", "store_waits"), ("bad_files", "bad_files"))  # a store's errors end as bad files
"""Seconds between frames, and between ``--once``'s two snapshots."""
QUIT_KEYS = b"qQ\x03"
"""Keys that quit (Ctrl-C too, should the terminal pass it on as a key)."""
VERDICT_STYLES = {"fed": "green", "somewhat input-bound": "yellow", "input-bound": "bold red"}
TRAINER_COLUMNS = "TRAINER CLIENT FEED >WAIT VERDICT >BATCHES/S >IMAGES/S >LAG >DECODES"
FEED_COLUMNS = "FEED >IMAGES/S SLOTS >BAD_FILES SAMPLE_CACHE"
SOURCE_COLUMNS = "TRAINER SOURCE >SERVED >SHARE >ASKED >PASS >POSITION"
SOURCE_KEYS = ("source", "served", "share", "asked", "pass", "position")
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
        "trainers_left_out": _count(body.get("sessions_left_out")),
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
        "sources": [dict(row) for row in _list(s.get("sources")) if isinstance(row, Mapping)],
        "encode_share": _number(s.get("encode_share")),
    }  # fmt: skip


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


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
    return Group(_header(frame, hint), _trainer_table(frame["trainers"]), _source_table(frame["trainers"]),
                 _feed_table(frame["feeds"]), _worker_lines(frame["workers"]),
                 Text(store if bad is not None else ""))  # fmt: skip


def _source_table(trainers: list[dict[str, Any]]) -> RenderableType:
    """Each trainer's ledger by source, for feeds of several (NOTE [ Source ledger ])."""
    rows = [(t["session"], row) for t in trainers for row in t.get("sources", [])]
    if not rows:
        return Text("")
    table = _table("sources (share: of the trainer's rows; asked: by its weights now)", SOURCE_COLUMNS)
    for session, row in rows:
        _add_row(table, _cell(session), *(_cell(row.get(key)) for key in SOURCE_KEYS))
    return table


def _header(frame: Frame, hint: str) -> Text:
    text = Text.assemble(("loader-service top ", "bold"), _cell(frame["endpoint"]))
    left_out = frame.get("trainers_left_out")  # NOTE [ A status fits one frame ]
    more = f" ({left_out} more not listed)" if left_out else ""
    text.append(f"  up {_duration(frame['uptime_s'])}  {len(frame['trainers'])} trainer(s){more}  {hint}")
    if frame["lost"]:
        text.append(f"\nservice lost: {_cell(frame['lost'])}; still trying", style="bold red")
    return text


def _trainer_table(trainers: list[dict[str, Any]]) -> RenderableType:
    if not trainers:
        return Text("no trainers attached")
    table = _table("trainers (wait: share of the step, last 10 s)", TRAINER_COLUMNS)
    for t in trainers:
        _add_row(
            table, _cell(t["session"]), _cell(t["client"]), _cell(t["feed"]), f"{100 * t['wait_share']:.0f}%",
            Text(t["verdict"], style=VERDICT_STYLES.get(t["verdict"], "")),
            _cell(t["batches_per_s"]), _cell(t["images_per_s"]), _cell(t["lag"]), _decodes(t["encode_share"]),
        )  # fmt: skip
    return table


def _decodes(share: float | None) -> str:
    """The share of its rows a trainer decodes itself (NOTE [ Encoded rows ]): blank for none."""
    return "" if not share else f"{100 * share:.0f}%"


def _feed_table(feeds: list[dict[str, Any]]) -> RenderableType:
    if not feeds:
        return Text("no feeds reported")
    table = _table("feeds", FEED_COLUMNS)
    for f in feeds:
        states = ", ".join(f"{f['slots'][state]} {state}" for state in SLOT_STATES)
        slots = f"{f['slots_in_use']} used of {_cell(f['slots_most'])}: {states}"
        _add_row(table, _cell(f["name"]), _cell(f["images_per_s"]), slots, _cell(f["bad_files"]),
                 _cache_cell(f["cache"]))  # fmt: skip
    return table


def _add_row(table: Table, *cells: str | Text) -> None:
    """A row of text: a string is never read as rich markup (a trainer named ``[/]``)."""
    table.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in cells))


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
    full = " (full)" if cache["full"] else ""
    return f"{_cell(cache['kind'])}: {_percent(cache['hit_rate'])} hits{last}{full}"


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
                    f"{_duration(last.get('seconds_ago'))} ago: {_cell(last.get('reason'))}")  # fmt: skip
    return text


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _cell(value: object) -> str:
    """A value as text (NOTE [ Chosen names are shown as text ])."""
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return "-" if value is None else printable(value)
