"""The service's status: the ``status?`` reply, systemd's one-line STATUS= and the metrics source.

Every list is bounded so a reply always fits one frame (NOTE [ A status fits one frame ]). What
the service sees of each trainer from its streams is read here too: its ``lag``, and whether it is
``starved``, which the load's demand is bounded by (NOTE [ Fleet load ]).

NOTE [ A status fits one frame ]
    A status reply is one frame of at most ``protocol.MAX_FRAME_BYTES`` (64 KiB), and a reply over
    it is never sent: ``status`` and ``top`` then see nothing at all. Its size follows from names
    and counts that others choose (a trainer's client name, 128 characters of up to 4 bytes; its
    group's, 64; the sources of a feed; the bad files' paths, 200 characters each), so no count of
    sessions is safe by itself: 100 sessions with the longest names make about 100 KB. So the
    snapshot is built to fit: the service's own figures first, then the feeds and then the
    sessions (at most ``STATUS_SESSIONS``, in the order they attached), each kept while the
    packed sizes add up to less than the frame less ``STATUS_RESERVE``, the rest counted in
    ``feeds_left_out`` and ``sessions_left_out``, which ``status`` and ``top`` print. Metrics
    read the same snapshot, so their per-trainer series cover the listed sessions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import msgpack

from loader_service.shm import SHM_DIR, shm_floor
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.ledger import source_status
from loader_service.supervisor.trainers.load import Load
from loader_service.supervisor.trainers.sessions import Session
from loader_service.supervisor.workers.pool import WorkerSet
from protocol.encoded import MAX_SHARE
from protocol.messages import MAX_FRAME_BYTES
from protocol.printable import printable
from protocol.status import ServiceStatus, SessionStatus, ShmStatus, SizingStatus, WorkerStatus, to_body

STATUS_SESSIONS = 100
STATUS_WORKERS = 64
STATUS_FEEDS = 16
STATUS_RESERVE = 8 * 1024
"""Bytes of a status frame not given to the feeds and sessions: the reply's envelope and the
lists' headers."""
Body = dict[str, Any]
"""A record of the body as the maps it travels as (``protocol.status.to_body``)."""


def summary(feeds: list[Feed], attached: Attachments) -> str:
    """One line for systemd's STATUS= (``systemctl status``): a newline would end the assignment
    (NOTE [ Chosen names are shown as text ])."""
    per_feed = "; ".join(
        f"{printable(f.name)}: {f.counters.decoded.rate():.0f} img/s, "
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


def _session(feeds: list[Feed], attached: Attachments, s: Session, now: float) -> SessionStatus:
    return SessionStatus(
        session=s.session_id,
        client=s.client,
        feed=feeds[s.feed].name,
        mode=s.mode,
        rank=s.rank,
        world_size=s.world_size,
        group=s.group if s.mode == "broadcast" else "",
        epoch=s.epoch,
        delivered=s.delivered,
        leased=len(s.leases),
        resent=s.resent,
        recovered_releases=s.recovered,
        credits=s.credits,
        credits_asked=s.hello.credits,
        lag=lag(attached, s),
        idle_seconds=round(now - s.last_seen, 1),
        demand=round(s.loop.demand(), 3),
        encode_share=round(s.encode / MAX_SHARE, 3),
        spoiled=s.spoiled,
        sources=source_status(feeds[s.feed], attached.streams.get(s.stream_key()), s.served),
    )


def _workers(workers: WorkerSet | None) -> tuple[WorkerStatus, ...]:
    if workers is None:
        return ()
    listed = [
        WorkerStatus(
            worker=h.worker,
            pid=h.process.pid,
            task=h.task,
            ready=h.routing_id is not None,
            decoded=h.decoded.total,
            images_per_second=round(h.decoded.rate(), 1),
        )
        for h in workers
    ]
    return tuple(listed[:STATUS_WORKERS])


def shm_space(folder: str | os.PathLike[str] = SHM_DIR) -> ShmStatus | None:
    """The bytes free and in all of the file system the segments live on (/dev/shm), as ``df`` says:
    where it is full a sample cache fails to start, and a slot pool stops growing at the floor it
    keeps free for others (NOTE [ A /dev/shm floor ]). None where it cannot be read. One ``statvfs``."""
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    size = fs.f_blocks * fs.f_frsize
    return ShmStatus(free_bytes=fs.f_bavail * fs.f_frsize, size_bytes=size, floor_bytes=shm_floor(size))


def snapshot(
    feeds: list[Feed],
    attached: Attachments,
    workers: WorkerSet | None,
    started_at: float,
    rejected_messages: int,
    sizing: SizingStatus,
    remote_send_bytes: int = 0,
    load: Load | None = None,
) -> dict[str, object]:
    """The body of a status reply: the whole service (NOTE [ Status contract ])."""
    now = time.monotonic()
    sessions = list(attached.sessions.values())[:STATUS_SESSIONS]
    whole = ServiceStatus(
        uptime=round(now - started_at, 1),
        attached=len(attached.sessions),
        workers=0 if workers is None else sum(1 for _ in workers),
        worker_restarts=0 if workers is None else workers.restarts,
        template_restarts=0 if workers is None else workers.template_restarts,
        rejected_messages=rejected_messages,
        remote_send_bytes=remote_send_bytes,
        load=(load or Load(0.0, 1.0)).status(),
        shm=shm_space(),
        sizing=sizing,
        worker_list=_workers(workers),
        feeds=(),
        feeds_left_out=len(feeds),
        sessions=(),
        sessions_left_out=len(attached.sessions),
    )
    # NOTE [ A status fits one frame ]: the feeds, then the sessions, in what the rest leaves.
    body: dict[str, object] = to_body(whole)
    room = MAX_FRAME_BYTES - STATUS_RESERVE - _packed(body)
    listed_feeds, room = _fitting((to_body(feed.status()) for feed in feeds[:STATUS_FEEDS]), room)
    listed, _ = _fitting((to_body(_session(feeds, attached, s, now)) for s in sessions), room)
    body.update(feeds=listed_feeds, feeds_left_out=len(feeds) - len(listed_feeds))
    body.update(sessions=listed, sessions_left_out=len(attached.sessions) - len(listed))
    return body


def _fitting(records: Iterable[Body], room: int) -> tuple[list[Body], int]:
    """The first of ``records`` whose packed sizes add up to at most ``room``, and the room left."""
    kept: list[Body] = []
    for record in records:
        size = _packed(record)
        if size > room:
            break
        kept.append(record)
        room -= size
    return kept, room


def _packed(value: object) -> int:
    return len(msgpack.packb(value, use_bin_type=True))
