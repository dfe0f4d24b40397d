"""The service's status: the ``status?`` reply, systemd's one-line STATUS= and the metrics source.

Every list is bounded so a reply always fits one frame (``protocol.MAX_FRAME_BYTES``). What the
service sees of each trainer from its streams is read here too: its ``lag``, and whether it is
``starved``, which the load's demand is bounded by (NOTE [ Fleet load ]).
"""

from __future__ import annotations

import os
import time

from loader_service.shm import SHM_DIR
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.ledger import source_status
from loader_service.supervisor.trainers.load import Load
from loader_service.supervisor.trainers.sessions import Session
from loader_service.supervisor.workers.pool import WorkerSet

STATUS_SESSIONS = 100
STATUS_WORKERS = 64
STATUS_FEEDS = 16


def summary(feeds: list[Feed], attached: Attachments) -> str:
    """One line for systemd's STATUS= (``systemctl status``)."""
    per_feed = "; ".join(
        f"{f.name}: {f.counters.decoded.rate():.0f} img/s, "
        f"{f.pool.counts()['leased']}/{len(f.pool)} slots leased (up to {f.pool.capacity})"
        for f in feeds
    )
    return f"{len(attached.sessions)} trainers; {per_feed}"


def lag(attached: Attachments, session: Session) -> int:
    """Batches decoded for this trainer's stream that it has not taken yet."""
    stream = attached.streams.get(session.stream_key())
    member = None if stream is None else stream.members.get(session.session_id)
    if stream is None or member is None or not member.active:
        return 0
    if stream.picked:  # a picked run: decoded, asked for, not yet announced to it
        return sum(1 for batch in stream.batches.values() if session.session_id in batch.pending)
    return max(0, stream.next_produce - stream.filling - member.next_send)


def _session(feeds: list[Feed], attached: Attachments, s: Session, now: float) -> dict[str, object]:
    return {
        "session": s.session_id,
        "client": s.client,
        "feed": feeds[s.feed].name,
        "mode": s.mode,
        "rank": s.rank,
        "world_size": s.world_size,
        "group": s.group if s.mode == "broadcast" else "",
        "epoch": s.epoch,
        "delivered": s.delivered,
        "leased": len(s.leases),
        "resent": s.resent,
        "recovered_releases": s.recovered,
        "credits": s.credits,
        "lag": lag(attached, s),
        "idle_seconds": round(now - s.last_seen, 1),
        "demand": round(s.loop.demand(), 3),
        "sources": source_status(feeds[s.feed], attached.streams.get(s.stream_key()), s.served),
    }


def _workers(workers: WorkerSet | None) -> list[dict[str, object]]:
    if workers is None:
        return []
    listed: list[dict[str, object]] = [
        {
            "worker": h.worker,
            "pid": h.process.pid,
            "task": h.task,
            "ready": h.routing_id is not None,
            "decoded": h.decoded.total,
            "images_per_second": round(h.decoded.rate(), 1),
        }
        for h in workers
    ]
    return listed[:STATUS_WORKERS]


def shm_space(folder: str | os.PathLike[str] = SHM_DIR) -> dict[str, int] | None:
    """The bytes free and in all of the file system the segments live on (/dev/shm), as ``df`` says:
    where it is full a sample cache fails to start, and a slot pool stops growing
    (NOTE [ A pool as large as what is in flight ]). None where it cannot be read. One ``statvfs``."""
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    return {"free_bytes": fs.f_bavail * fs.f_frsize, "size_bytes": fs.f_blocks * fs.f_frsize}


def snapshot(
    feeds: list[Feed],
    attached: Attachments,
    workers: WorkerSet | None,
    started_at: float,
    rejected_messages: int,
    remote_send_bytes: int = 0,
    load: Load | None = None,
) -> dict[str, object]:
    """A JSON-shaped snapshot of the whole service."""
    now = time.monotonic()
    sessions = list(attached.sessions.values())[:STATUS_SESSIONS]
    worker_list = _workers(workers)
    return {
        "worker_list": worker_list,
        "uptime": round(now - started_at, 1),
        "feeds": [feed.status() for feed in feeds[:STATUS_FEEDS]],
        "sessions": [_session(feeds, attached, s, now) for s in sessions],
        "attached": len(attached.sessions),
        "workers": 0 if workers is None else sum(1 for _ in workers),
        "worker_restarts": 0 if workers is None else workers.restarts,
        "rejected_messages": rejected_messages,
        "remote_send_bytes": remote_send_bytes,
        "load": (load or Load(0.0, 1.0)).status(),
        "shm": shm_space(),
    }
