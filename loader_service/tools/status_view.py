"""``loader-service status``: ask a running service for its snapshot and show it as tables.

The snapshot is the body of a ``status`` reply (``LoaderService.status``), declared in
``protocol/status.py`` (NOTE [ Status contract ]); a service of another release may lack a field or
give it another type, so every field is read defensively and a missing one shows as ``-``. Every
value is shown as text: a name a trainer or a dataset chose never reaches the terminal as an
escape (NOTE [ Chosen names are shown as text ]).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq

from protocol.codec import decode, encode
from protocol.curve import ClientKeys
from protocol.messages import ErrorReply, Heartbeat, ProtocolError, StatusReply, StatusRequest
from protocol.printable import printable
from protocol.status import SLOT_STATES

RECENT_BAD_FILES = 3  # paths shown per feed; the service keeps the last five
Column = tuple[str, str]  # (title, "<" or ">")


def query_status(
    endpoint: str, timeout: float, server_key: str | None = None, client_key: str | None = None
) -> dict[str, Any]:
    """The status body of the service at ``endpoint``; ``TimeoutError`` naming it if none comes in time.

    ``RuntimeError`` if the service answers with an error, ``ValueError`` for a malformed endpoint or
    key file. CURVE keys as for a trainer (``protocol.curve``, environment included).
    """
    keys = ClientKeys.load(server_key, client_key)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply(sock)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"invalid endpoint {endpoint!r}: {exc}") from None
        sock.send(encode(StatusRequest()), zmq.NOBLOCK)
        return _await_reply(sock, endpoint, time.monotonic() + timeout, timeout)
    finally:
        ctx.destroy(linger=0)


def _await_reply(sock: zmq.Socket[bytes], endpoint: str, deadline: float, timeout: float) -> dict[str, Any]:
    not_understood = ""
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(max(1, int(left * 1000))):
            break
        frame = sock.recv_multipart()[-1]
        try:
            msg = decode(frame, (StatusReply, Heartbeat, ErrorReply))
        except ProtocolError as exc:
            not_understood = f"; a reply was not understood: {exc}"
            continue
        if isinstance(msg, StatusReply):
            return dict(msg.body)
        if isinstance(msg, ErrorReply):
            raise RuntimeError(f"the service at {endpoint} refused the status request: {msg.message}")
    raise TimeoutError(
        f"no status reply from {endpoint} within {timeout:g} s{not_understood}{_endpoint_hint(endpoint)}"
    )


def _endpoint_hint(endpoint: str) -> str:
    if endpoint.startswith("ipc://") and not Path(endpoint[len("ipc://") :]).exists():
        return f" (nothing at {endpoint[len('ipc://') :]}: is loader-service running?)"
    return " (is loader-service running there?)"


def main_status(
    endpoint: str, as_json: bool, timeout: float, server_key: str | None = None, client_key: str | None = None
) -> int:
    """``loader-service status``: print the snapshot; 0 on success, 1 (message on stderr) otherwise."""
    try:
        body = query_status(endpoint, timeout, server_key, client_key)
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f"loader-service status: {printable(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2, sort_keys=True) if as_json else render(body))
    return 0


# --- rendering ----------------------------------------------------------------------------------


def render(body: Mapping[str, Any]) -> str:
    """The snapshot as a summary line and one table per feed, worker and trainer."""
    sections = [
        _summary(body),
        _feeds(_records(body, "feeds")) + _left_out(body.get("feeds_left_out"), "feed"),
        _workers(_records(body, "worker_list")),
        _trainers(_records(body, "sessions")) + _left_out(body.get("sessions_left_out"), "trainer"),
        _sources(_records(body, "sessions")),
    ]
    return "\n\n".join(section for section in sections if section)


def _left_out(count: object, what: str) -> str:
    """NOTE [ A status fits one frame ]: what the service left out of its reply, if anything."""
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        return ""
    return f"\n{count} more {what}(s) not listed: the status reply fits one frame"


def _records(body: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = body.get(key)
    return [r for r in items if isinstance(r, Mapping)] if isinstance(items, list) else []


def _summary(body: Mapping[str, Any]) -> str:
    attached = body.get("attached", len(_records(body, "sessions")))
    workers = body.get("workers", len(_records(body, "worker_list")))
    return (
        f"loader-service up {_duration(body.get('uptime'))}: {_cell(attached)} trainer(s) attached, "
        f"{_cell(workers)} decode worker(s), {_cell(body.get('worker_restarts'))} worker restart(s), "
        f"{_cell(body.get('rejected_messages'))} rejected message(s)"
        f"{_sizing_line(body.get('sizing'))}{_load_line(body.get('load'))}"
    )


def _sizing_line(sizing: object) -> str:
    """NOTE [ Sizing workers ]: workers taking tasks of those started (and the most there may be),
    and the last decision."""
    if not isinstance(sizing, Mapping):
        return ""
    line = f"\nworkers: {_cell(sizing.get('active'))} of {_cell(sizing.get('started'))} taking tasks"
    if sizing.get("mode") != "auto":
        return line + " (--workers)"
    line += f" (auto, up to {_cell(sizing.get('most'))}, CPU budget {_cell(sizing.get('budget'))} cores)"
    decisions = sizing.get("decisions")
    last = decisions[-1] if isinstance(decisions, list) and decisions else None
    if isinstance(last, Mapping):
        line += (
            f"; {_cell(last.get('from'))} -> {_cell(last.get('to'))} "
            f"{_duration(last.get('seconds_ago'))} ago: {_cell(last.get('reason'))}"
        )
    return line


def _load_line(load: object) -> str:
    """NOTE [ Fleet load ]: what an autoscaler reads, and the two figures it is made of."""
    if not isinstance(load, Mapping):
        return ""
    figures = [load.get(key) for key in ("load", "busy", "demand")]
    if not all(isinstance(x, (int, float)) for x in figures):
        return ""
    total, busy, demand = figures
    return f"\nload {total:.2f} (workers busy {busy:.2f} x trainers' demand {demand:.2f}, last 10 s)"


def _feeds(feeds: list[Mapping[str, Any]]) -> str:
    if not feeds:
        return "no feeds reported"
    columns: list[Column] = [
        ("FEED", "<"), ("SAMPLES", ">"), ("IMAGES/S", ">"), ("DECODED", ">"), ("BATCHES", ">"),
        ("FREE", ">"), ("FILLING", ">"), ("READY", ">"), ("LEASED", ">"), ("MOST", ">"), ("BAD FILES", ">"),
    ]  # fmt: skip
    keys = ("name", "samples", "images_per_second", "decoded", "batches")
    rows = [
        [*(f.get(k) for k in keys), *_slot_counts(f), f.get("slots_most"), f.get("bad_files")] for f in feeds
    ]
    lines = _table(columns, rows)
    for f in feeds:
        if f.get("fields"):
            what = f"{_cell(f.get('format'))} data, {_cell(f.get('augment'))}"
            lines.append(f"  {_cell(f.get('name'))}: {what}; fields {', '.join(map(_cell, f['fields']))}")
        cache = f.get("cache")
        if isinstance(cache, Mapping):
            lines.append(f"  {_cell(f.get('name'))}: {_cache_line(cache)}")
        recent = f.get("recent_bad_files")
        if isinstance(recent, list) and recent:
            shown = ", ".join(_cell(p) for p in recent[-RECENT_BAD_FILES:])
            lines.append(f"  last bad files in {_cell(f.get('name'))}: {shown}")
    return "\n".join(lines)


def _cache_line(cache: Mapping[str, Any]) -> str:
    """``sample cache (decoded): 812 entries, 3.00 of 4.00 GiB, full; 2436 hits, 812 misses (75% hits)``."""
    hits, misses = cache.get("hits"), cache.get("misses")
    looked = hits + misses if isinstance(hits, int) and isinstance(misses, int) else 0
    share = f" ({100 * hits / looked:.0f}% hits)" if looked and isinstance(hits, int) else ""
    full = ", full" if cache.get("full") else ""
    timeouts = cache.get("lock_timeouts")
    stuck = f"; {timeouts} stores given up: its lock was held too long" if timeouts else ""
    return (
        f"sample cache ({_cell(cache.get('kind'))}): {_cell(cache.get('entries'))} entries, "
        f"{_gib(cache.get('bytes_used'))} of {_gib(cache.get('bytes'))} GiB{full}; "
        f"{_cell(hits)} hits, {_cell(misses)} misses{share}{stuck}"
    )


def _gib(value: object) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, int) and not isinstance(value, bool) else "-"


def _slot_counts(feed: Mapping[str, Any]) -> list[object]:
    slots = feed.get("slots")
    return [slots.get(state) if isinstance(slots, Mapping) else None for state in SLOT_STATES]


def _workers(workers: list[Mapping[str, Any]]) -> str:
    if not workers:
        return "no decode workers reported"
    columns: list[Column] = [
        ("WORKER", "<"), ("PID", ">"), ("READY", "<"), ("TASK", ">"), ("DECODED", ">"), ("IMAGES/S", ">"),
    ]  # fmt: skip
    keys = ("worker", "pid", "ready", "task", "decoded", "images_per_second")
    return "\n".join(_table(columns, [[w.get(k) for k in keys] for w in workers]))


def _trainers(sessions: list[Mapping[str, Any]]) -> str:
    if not sessions:
        return "no trainers attached"
    columns: list[Column] = [
        ("TRAINER", "<"), ("CLIENT", "<"), ("FEED", "<"), ("MODE", "<"), ("SHARD/GROUP", "<"),
        ("EPOCH", ">"), ("DELIVERED", ">"), ("LEASED", ">"), ("CREDITS", ">"), ("LAG", ">"),
        ("DEMAND", ">"), ("IDLE", ">"),
    ]  # fmt: skip
    head = ("session", "client", "feed", "mode")
    counts = ("epoch", "delivered", "leased", "credits", "lag", "demand")
    rows = [
        [*(s.get(k) for k in head), _shard_or_group(s), *(s.get(k) for k in counts), _idle(s)]
        for s in sessions
    ]
    return "\n".join(_table(columns, rows))


def _sources(sessions: list[Mapping[str, Any]]) -> str:
    """Each trainer's ledger by source, for feeds of several (NOTE [ Source ledger ]); "" if none."""
    columns: list[Column] = [
        ("TRAINER", "<"), ("SOURCE", "<"), ("SERVED", ">"), ("SHARE", ">"), ("ASKED", ">"),
        ("PASS", ">"), ("POSITION", ">"),
    ]  # fmt: skip
    keys = ("source", "served", "share", "asked", "pass", "position")
    rows = [
        [s.get("session"), *(row.get(k, "-") for k in keys)]
        for s in sessions
        for row in s.get("sources") or []
        if isinstance(row, Mapping)
    ]
    return "\n".join(_table(columns, rows)) if rows else ""


def _idle(session: Mapping[str, Any]) -> str:
    return _duration(session.get("idle_seconds"))


def _shard_or_group(session: Mapping[str, Any]) -> str:
    if session.get("mode") == "broadcast":
        return _cell(session.get("group"))
    return f"{_cell(session.get('rank'))}/{_cell(session.get('world_size'))}"


def _table(columns: Sequence[Column], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(title), *(len(r[i]) for r in cells)) for i, (title, _) in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [f"{v:{align}{w}}" for v, (_, align), w in zip(values, columns, widths, strict=True)]
        return "  ".join(parts).rstrip()

    return [line([title for title, _ in columns]), *(line(r) for r in cells)]


def _cell(value: object) -> str:
    """A value as text (NOTE [ Chosen names are shown as text ])."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return printable(value)


def _duration(seconds: object) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``, ``3 d 04 h``; ``-`` when not a number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole >= 86400:
        return f"{whole // 86400} d {whole % 86400 // 3600:02d} h"
    if whole >= 3600:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 60} min {whole % 60:02d} s"
