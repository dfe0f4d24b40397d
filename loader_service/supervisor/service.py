"""The loader service process: its feeds, their slot pools, the decode workers and the trainer endpoint.

The main thread runs one loop (NOTE [ Main loop ]); nothing else touches sockets or slot states.

NOTE [ Main loop ]
    Each turn, in this order: poll both sockets (at most ``TICK`` seconds); handle trainer messages;
    handle worker reports; react to a recorded signal; reap and replace dead workers (their tasks are
    redone); expire trainers whose heartbeats stopped and evict broadcast members that hold their
    group up; send heartbeats; hand tasks to idle workers. Signal handlers only record the signal,
    so shutdown always runs from here in a known state.

NOTE [ Shutdown order ]
    1. Stop scheduling: no new task is handed out once a stop signal is recorded.
    2. Send ``stop`` to every worker and join them (``STOP_GRACE`` seconds), then terminate, then kill:
       no worker outlives the service or writes into a pool that is going away.
    3. Close the sockets with linger 0 and terminate the ZeroMQ context, so exit never hangs on peers.
       Trainers notice the silence through their heartbeat timeout.
    4. Unmap and unlink every feed's shared-memory segment (NOTE [ Shared-memory cleanup ]), then
       remove the private runtime directory (worker socket, index files).
    Steps 2-4 run from ``finally``, so an exception during start-up or in the loop cleans up too.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import numpy as np
import zmq

from loader_service.config import ServiceConfig
from loader_service.dataset.sampler import shard_size
from loader_service.decode.transforms import describe_decoder
from loader_service.decode.worker import FAULT_ENV, WorkerConfig
from loader_service.logs import LogLimiter
from loader_service.shm import LOCK_NAME, SHM_DIR, hold_lock, remove_stale, restrict
from loader_service.supervisor import systemd
from loader_service.supervisor.endpoint import claim_ipc_path, ipc_path, release_ipc_path
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.metrics import ServiceMetrics
from loader_service.supervisor.sessions import Session
from loader_service.supervisor.slots import SlotState
from loader_service.supervisor.streams import Member, StartRefused, Stream
from loader_service.supervisor.warm import WarmCache
from loader_service.supervisor.worker_pool import WorkerSet
from protocol.layout import SEGMENT_PREFIX
from protocol.messages import (
    MAX_FRAME_BYTES,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Start,
    StatusReply,
    StatusRequest,
    StopWorker,
    Task,
    TaskDone,
    Welcome,
    WorkerReady,
    decode,
    encode,
)

log = logging.getLogger(__name__)
TICK = 0.1
STOP_GRACE = 5.0
MAX_TASK_ATTEMPTS = 3
STATUS_SESSIONS = 100
STATUS_WORKERS = 64
"""Bounds on the lists in a status reply, which must fit one frame (protocol.MAX_FRAME_BYTES)."""
TRAINER_MESSAGES = (Hello, Start, Release, Heartbeat, Bye, StatusRequest)
WORKER_MESSAGES = (WorkerReady, TaskDone)
StreamKey = tuple[object, ...]


@dataclass(frozen=True)
class TaskRecord:
    task: int
    feed: int
    stream: StreamKey
    gen: int
    seq: int
    epoch: int
    slot: int
    indices: bytes
    attempts: int = 0


class LoaderService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.feeds: list[Feed] = []
        self.rejected_messages = 0
        self._started_at = time.monotonic()
        self._signal: int | None = None
        self._sessions: dict[bytes, Session] = {}
        self._by_session_id: dict[str, bytes] = {}
        self._streams: dict[StreamKey, Stream] = {}
        self._rr: deque[StreamKey] = deque()
        self._tasks: dict[int, TaskRecord] = {}
        self._redo: deque[TaskRecord] = deque()
        self._next_task = 0
        self._next_lease = 0
        self._last_heartbeat = 0.0
        self._runtime_dir: Path | None = None
        self._runtime_lock: int | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._workers: WorkerSet | None = None
        self._owns_endpoint = False
        self._fatal: str | None = None
        self._watchdog = systemd.Watchdog()
        self._metrics: ServiceMetrics | None = None
        self._warm: dict[int, WarmCache] = {}
        self._last_report = 0.0
        self._reject_log = LogLimiter("rejected messages", per_minute=30)

    # --- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; return the process exit code."""
        self._install_signal_handlers()
        try:
            self._start()
            self._loop()
        finally:
            self.shutdown()
        if self._fatal is not None:
            log.error("stopped: %s", self._fatal)
            return 1
        log.info("stopped cleanly")
        return 0

    def _install_signal_handlers(self) -> None:
        def record(signum: int, frame: FrameType | None) -> None:
            self._signal = signum

        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)

    def _start(self) -> None:
        cfg = self.config
        log.info("config: %s", cfg.summary())
        for path in remove_stale((SHM_DIR, Path(tempfile.gettempdir()))):
            log.warning("removed %s, left behind by a service that was killed", path)
        self._runtime_dir = Path(tempfile.mkdtemp(prefix=f"{SEGMENT_PREFIX}{os.getpid()}-"))
        self._runtime_lock = hold_lock(self._runtime_dir / LOCK_NAME)
        for feed_id, feed_config in enumerate(cfg.feeds()):
            self.feeds.append(Feed.open(feed_id, feed_config, self._runtime_dir, cfg.group))
        self._ctx = zmq.Context()
        self._frontend = self._bind_frontend(self._ctx)
        backend_endpoint = f"ipc://{self._runtime_dir}/workers.sock"
        self._backend = self._ctx.socket(zmq.ROUTER)
        self._backend.setsockopt(zmq.LINGER, 0)
        self._backend.bind(backend_endpoint)
        # Read by OpenCV when a worker imports it: refuse decompression bombs before allocating.
        os.environ["OPENCV_IO_MAX_IMAGE_PIXELS"] = str(cfg.max_pixels)
        self._workers = WorkerSet(self._worker_template(backend_endpoint), cfg.workers)
        log.info("decoder: %s", describe_decoder(cfg.decoder))
        self._warm = {feed.id: WarmCache(feed) for feed in self.feeds}
        if cfg.metrics_port:
            self._metrics = ServiceMetrics()
            self._metrics.start(cfg.metrics_port, cfg.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", cfg.metrics_addr, cfg.metrics_port)
        for feed in self.feeds:
            log.info(
                "ready: feed %r, %d samples in %d classes, %d batches/epoch of %d, "
                "pool %d slots x %.1f MiB (%s), listening on %s",
                feed.name,
                len(feed.index),
                len(feed.index.classes),
                feed.shard_batches(1, "pad"),
                feed.config.batch_size,
                feed.config.slots,
                feed.layout.stride / 2**20,
                feed.segment.name,
                cfg.endpoint,
            )
        systemd.ready(self._summary())

    def _bind_frontend(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        claim_ipc_path(self.config.endpoint)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.bind(self.config.endpoint)
        self._owns_endpoint = True
        path = ipc_path(self.config.endpoint)
        if path is not None:
            restrict(path, self.config.group)  # only the service's user (and group) may connect
        return sock

    def _worker_template(self, backend: str) -> WorkerConfig:
        return WorkerConfig(
            worker=0,
            parent_pid=os.getpid(),
            backend=backend,
            feeds=tuple(feed.worker_feed() for feed in self.feeds),
            log_level=self.config.log_level,
            roi=self.config.roi,
        )

    def shutdown(self) -> None:
        """NOTE [ Shutdown order ] steps 2-4; safe to call on a partly started service."""
        if self._workers is not None:
            for h in self._workers:
                if h.routing_id is not None:
                    self._send_worker(h.routing_id, StopWorker())
            self._workers.join(time.monotonic() + STOP_GRACE)
            self._workers = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        for feed in self.feeds:
            feed.close()
        self.feeds = []
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
        if self._runtime_lock is not None:
            os.close(self._runtime_lock)
            self._runtime_lock = None
        if self._owns_endpoint:
            release_ipc_path(self.config.endpoint)
            self._owns_endpoint = False
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None

    # --- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._backend, zmq.POLLIN)
        if os.environ.get(FAULT_ENV) == "main-loop":
            raise RuntimeError(f"fault injected by {FAULT_ENV}")
        while True:
            events = dict(poller.poll(int(TICK * 1000)))
            if self._frontend in events:
                self._drain(self._frontend, self._on_trainer_frames)
            if self._backend in events:
                self._drain(self._backend, self._on_worker_frames)
            if self._signal is not None:
                log.info("received %s; shutting down", signal.Signals(self._signal).name)
                systemd.stopping()
                return
            if self._fatal is not None:
                return
            self._reap_workers()
            now = time.monotonic()
            self._expire_sessions(now)
            self._evict_laggards(now)
            self._send_heartbeats(now)
            self._schedule()
            self._report(now)

    @staticmethod
    def _drain(sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None]) -> None:
        # Bounded so that a flood on one socket cannot starve the other or the signal check.
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    # --- trainers -------------------------------------------------------------------------------

    def _on_trainer_frames(self, frames: list[bytes]) -> None:
        routing_id = frames[0]
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected one frame, got {len(frames) - 1}")
            msg = decode(frames[1], TRAINER_MESSAGES)
        except ProtocolError as exc:
            self._reject(routing_id, "bad-message", str(exc))
            return
        self._on_trainer_message(routing_id, msg)

    def _on_trainer_message(self, routing_id: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(routing_id, msg)
            return
        if isinstance(msg, StatusRequest):
            self._send(routing_id, StatusReply(self.status()))
            return
        if isinstance(msg, Heartbeat) and msg.session:
            beating = self._session_by_id(msg.session)
            if beating is not None:
                beating.last_seen = time.monotonic()
            return
        session = self._sessions.get(routing_id)
        if session is None:
            self._reject(
                routing_id, "no-session", "send hello first (the service may have restarted)", fatal=True
            )
            return
        session.last_seen = time.monotonic()
        if isinstance(msg, Start) and session.evicted:
            self._reject(
                routing_id, "evicted", "this trainer was evicted from its broadcast group", fatal=True
            )
        elif isinstance(msg, Start):
            self._on_start(session, msg)
        elif isinstance(msg, Release):
            self._on_release(session, msg)
        elif isinstance(msg, Bye):
            self._drop_session(session, "said bye")

    def _session_by_id(self, session_id: str) -> Session | None:
        routing_id = self._by_session_id.get(session_id)
        return None if routing_id is None else self._sessions.get(routing_id)

    def _find_feed(self, name: str) -> Feed | None:
        if not name:
            return self.feeds[0]
        return next((f for f in self.feeds if f.name == name), None)

    def _refusal(self, msg: Hello) -> str | None:
        """Why a hello cannot be served, or None."""
        feed = self._find_feed(msg.feed)
        if feed is None:
            served = ", ".join(repr(f.name) for f in self.feeds)
            return f"this service serves feed(s) {served}, not {msg.feed!r}"
        cfg = feed.config
        if msg.batch_size not in (0, cfg.batch_size) or msg.image_size not in (0, cfg.image_size):
            return (
                f"feed {feed.name!r} serves batches of {cfg.batch_size} images of {cfg.image_size}px; "
                f"this trainer asked for {msg.batch_size or 'any'} of {msg.image_size or 'any'}px"
            )
        if msg.mode == "broadcast":
            stream = self._streams.get(("broadcast", feed.id, msg.group or "default"))
            if stream is not None and stream.group_size != msg.group_size:
                return (
                    f"broadcast group {stream.group!r} has group_size {stream.group_size}, "
                    f"not {msg.group_size}"
                )
        return None

    def _on_hello(self, routing_id: bytes, msg: Hello) -> None:
        refusal = self._refusal(msg)
        if refusal is not None:
            self._reject(routing_id, "refused", refusal, fatal=True)
            return
        resumed = self._session_by_id(msg.resume) if msg.resume else None
        if resumed is not None and resumed.hello.pid == msg.pid and not resumed.evicted:
            self._rebind(resumed, routing_id, set(msg.held))
            return
        old = self._sessions.get(routing_id)
        if old is not None:
            self._drop_session(old, "said hello again")
        feed = self._find_feed(msg.feed)
        assert feed is not None
        session = Session(routing_id, secrets.token_hex(8), msg, feed.id, time.monotonic())
        self._sessions[routing_id] = session
        self._by_session_id[session.session_id] = routing_id
        stream = self._stream_for(session, feed)
        stream.add(session)
        log.info(
            "trainer %s (pid %d) attached to feed %r as session %s (%s)",
            msg.client,
            msg.pid,
            feed.name,
            session.session_id,
            f"shard {session.rank}/{session.world_size}"
            if session.mode == "shard"
            else f"broadcast group {session.group!r}",
        )
        self._send(routing_id, self._welcome(session))

    def _rebind(self, session: Session, routing_id: bytes, held: set[int]) -> None:
        """NOTE [ Reconnecting ]: a trainer that lost touch with this (live) service takes its session
        back on a new socket. The leases of batches its loop still holds keep their slots; the others
        (announcements lost on the old socket, releases not sent) are returned now."""
        stream = self._stream_of(session)
        for lease in [lease for lease in session.leases if lease not in held]:
            slot = stream.release(session.session_id, session.leases.pop(lease))
            if slot is not None:
                stream.feed.pool.release(slot)
        del self._sessions[session.routing_id]
        session.routing_id = routing_id
        session.last_seen = time.monotonic()
        self._sessions[routing_id] = session
        self._by_session_id[session.session_id] = routing_id
        log.info("session %s (%s) resumed on a new connection", session.session_id, session.client)
        self._send(routing_id, self._welcome(session))

    def _welcome(self, session: Session) -> Welcome:
        feed = self.feeds[session.feed]
        stream = self._stream_of(session)
        samples = shard_size(len(feed.index), stream.world_size, stream.remainder)
        return Welcome(
            session.session_id,
            feed.info(),
            self.config.heartbeat_interval,
            stream.batches_per_epoch(),
            samples,
        )

    def _stream_for(self, session: Session, feed: Feed) -> Stream:
        key = session.stream_key()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = Stream(key, feed, session)
            self._rr.append(key)
        return stream

    def _stream_of(self, session: Session) -> Stream:
        return self._streams[session.stream_key()]

    def _on_start(self, session: Session, msg: Start) -> None:
        stream = self._stream_of(session)
        session.run, session.epoch = msg.run, msg.epoch
        try:
            freed = stream.on_start(
                session.session_id, msg.epoch, msg.position, self._warm.get(stream.feed.id)
            )
        except StartRefused as exc:
            self._reject(session.routing_id, "bad-start", str(exc), fatal=True)
            return
        self._free(stream.feed, freed)
        self._deliver(stream)

    def _on_release(self, session: Session, msg: Release) -> None:
        stream = self._stream_of(session)
        unknown = 0
        for lease in msg.leases:
            key = session.leases.pop(lease, None)
            if key is None:
                unknown += 1
                continue
            slot = stream.release(session.session_id, key)
            if slot is not None:
                stream.feed.pool.release(slot)
        if unknown:
            self.rejected_messages += 1
            log.warning(
                "session %s released %d leases it does not hold; ignored", session.session_id, unknown
            )
        self._deliver(stream)

    def _free(self, feed: Feed, slots: list[int]) -> None:
        for slot in slots:
            feed.pool.release(slot)

    def _drop_session(self, session: Session, why: str) -> None:
        """Return every slot the session holds (NOTE [ Slot lifecycle ]: cancel and lease expiry)."""
        key = session.stream_key()
        stream = self._streams[key]
        self._free(stream.feed, stream.remove(session.session_id))
        log.info(
            "session %s (%s) detached: %s; %d leases returned",
            session.session_id,
            session.client,
            why,
            len(session.leases),
        )
        session.leases.clear()
        del self._sessions[session.routing_id]
        self._by_session_id.pop(session.session_id, None)
        if not stream.members and not stream.evicted:
            self._free(stream.feed, [b.slot for b in stream.batches.values()])
            if stream.ahead is not None:
                self._free(stream.feed, stream.ahead.drop())
            del self._streams[key]
            self._rr.remove(key)
        elif stream.broadcast:
            self._free(stream.feed, stream.on_member_left())
            self._deliver(stream)

    def _expire_sessions(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if now - session.last_seen > self.config.client_timeout:
                self._drop_session(session, f"no heartbeat for {self.config.client_timeout:.0f} s")

    def _evict_laggards(self, now: float) -> None:
        """NOTE [ Broadcast epochs ]: one member may not hold its group up beyond the lag timeout."""
        for stream in list(self._streams.values()):
            laggard = stream.laggard()
            if laggard is None:
                stream.blocked_since = None
                continue
            if stream.blocked_since is None:
                stream.blocked_since = now
            elif now - stream.blocked_since > self.config.lag_timeout:
                stream.blocked_since = None
                session = self._session_by_id(laggard)
                if session is not None:
                    self._evict(stream, session)

    def _evict(self, stream: Stream, session: Session) -> None:
        why = f"held broadcast group {stream.group!r} up for over {self.config.lag_timeout:.0f} s"
        log.warning("session %s (%s) evicted: %s", session.session_id, session.client, why)
        session.evicted = True
        self._free(stream.feed, stream.evict(session.session_id))
        self._free(stream.feed, stream.on_member_left())
        self._reject(session.routing_id, "evicted", f"evicted: {why}", fatal=True)
        self._deliver(stream)

    def _send_heartbeats(self, now: float) -> None:
        if now - self._last_heartbeat < self.config.heartbeat_interval:
            return
        self._last_heartbeat = now
        for routing_id in list(self._sessions):
            self._send(routing_id, Heartbeat())
        for stream in list(self._streams.values()):
            self._deliver(stream)  # retries announcements a full or briefly unreachable peer missed

    def _deliver(self, stream: Stream) -> None:
        """Announce what each member may receive, strictly in sequence order."""
        for member in stream.members.values():
            session = member.session
            for key, batch in stream.deliverable(member):
                lease = self._next_lease
                self._next_lease += 1
                announced = BatchReady(session.run, stream.epoch, key[1], lease, batch.slot, batch.count)
                if not self._send(session.routing_id, announced):
                    stream.undeliver(member, key)  # retried on the next delivery round
                    break
                if stream.feed.pool.state(batch.slot) is SlotState.READY:
                    stream.feed.pool.lease(batch.slot)
                session.leases[lease] = key
                session.delivered += 1
            self._maybe_end(stream, member)

    def _maybe_end(self, stream: Stream, member: Member) -> None:
        if member.active and not member.end_sent and member.next_send >= stream.end:
            member.end_sent = True
            session = member.session
            self._send(session.routing_id, EpochEnd(session.run, stream.epoch, stream.end))

    def _send(self, routing_id: bytes, msg: Message) -> bool:
        """Send without ever blocking the loop; False if the message did not go out."""
        try:
            self._frontend.send_multipart([routing_id, encode(msg)], zmq.NOBLOCK)
        except ProtocolError as exc:  # a reply too large for a frame: a bug, never worth the loop
            log.error("could not encode %s: %s", msg.KIND, exc)
            return False
        except zmq.ZMQError as exc:
            # Unreachable (gone) or full peer. A session that is really gone is reclaimed by its
            # heartbeat timeout, never sooner, so a trainer's mapped slots stay valid.
            log.debug("could not send %s to %r: %s", msg.KIND, routing_id, exc)
            return False
        return True

    def _reject(self, routing_id: bytes, code: str, message: str, fatal: bool = False) -> None:
        self.rejected_messages += 1
        if self._reject_log.allow(time.monotonic()):
            log.warning("rejected message from %r: %s", routing_id[:16], message)
        self._send(routing_id, ErrorReply(code, message[:2000], fatal))

    # --- workers --------------------------------------------------------------------------------

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames[-1], WORKER_MESSAGES)
        except ProtocolError as exc:
            log.error("bad message from a decode worker: %s", exc)
            return
        assert self._workers is not None
        if isinstance(msg, WorkerReady):
            handle = self._workers.get(msg.worker)
            if handle is not None and handle.process.pid == msg.pid:
                self._workers.mark_ready(handle, frames[0])
        elif isinstance(msg, TaskDone):
            self._on_task_done(msg)

    def _on_task_done(self, msg: TaskDone) -> None:
        assert self._workers is not None
        handle = self._workers.get(msg.worker)
        if handle is not None and handle.task == msg.task:
            handle.task = None
            handle.decoded.add(msg.count)
        record = self._tasks.pop(msg.task, None)
        if record is not None:  # else: a report from before a redo (NOTE [ Worker restarts ])
            self._complete(record, msg.count, msg.bad)

    def _complete(self, record: TaskRecord, count: int, bad: tuple[tuple[int, str], ...]) -> None:
        feed = self.feeds[record.feed]
        for idx, reason in bad:
            feed.note_bad(idx, reason)
            if self.config.strict and self._fatal is None:
                where = feed.index.relpath(idx) if 0 <= idx < len(feed.index) else f"sample {idx}"
                self._fatal = f"--strict: feed {feed.name!r}: {where}: {reason}"
        feed.counters.decoded.add(count)
        if record.stream[0] == "warm":
            feed.counters.warm_decoded += count
        lane = record.stream[0]
        stream = self._streams.get(record.stream[1:] if lane == "ahead" else record.stream)
        target: Stream | WarmCache | None = stream
        if lane == "warm":
            target = self._warm.get(record.feed)
        elif lane == "ahead":
            target = None if stream is None else stream.ahead
        # A cache's batch may have been handed to a stream while decoding (NOTE [ Warm start ]).
        receiver = target.forward_target(record.gen) if isinstance(target, WarmCache) else stream
        if target is None or not target.filled(record.gen, record.seq, record.slot, count):
            feed.pool.release(record.slot)  # its plan was abandoned while the slot was filling
            return
        feed.counters.batches += 1
        feed.pool.filled(record.slot)
        if isinstance(receiver, Stream):
            self._deliver(receiver)

    def _reap_workers(self) -> None:
        assert self._workers is not None
        self._workers.kill_stuck(time.monotonic(), self.config.task_timeout)
        for dead in self._workers.reap(time.monotonic()):
            record = self._tasks.pop(dead.task, None) if dead.task is not None else None
            if record is None:
                continue
            # The slot stays FILLING and is rewritten from scratch by whoever takes the redo. A fresh
            # task id makes a late ``done`` from the dead worker unrecognisable, so the slot can never
            # be announced while the redo is still writing it.
            self._next_task += 1
            redo = replace(record, task=self._next_task, attempts=record.attempts + 1)
            if redo.attempts < MAX_TASK_ATTEMPTS:
                self._redo.append(redo)
            else:
                self._give_up(redo)
        if self._workers.given_up and self._fatal is None:
            self._fatal = "decode workers keep failing at start-up; see their errors above"

    def _give_up(self, record: TaskRecord) -> None:
        """A batch that killed its decoder every time: report its files bad and deliver it empty."""
        reason = f"decode worker died {record.attempts} times on the batch holding this file"
        indices = np.frombuffer(record.indices, dtype="<i8").tolist()
        self._complete(record, 0, tuple((i, reason) for i in indices))

    def _send_worker(self, routing_id: bytes, msg: Message) -> None:
        try:
            self._backend.send_multipart([routing_id, encode(msg)], zmq.NOBLOCK)
        except (zmq.ZMQError, ProtocolError) as exc:
            log.debug("could not reach worker: %s", exc)

    def _schedule(self) -> None:
        assert self._workers is not None
        for handle in self._workers.idle():
            record = self._redo.popleft() if self._redo else self._next_job()
            if record is None:
                return
            assert handle.routing_id is not None
            handle.task, handle.task_since = record.task, time.monotonic()
            self._tasks[record.task] = record
            task = Task(record.task, record.feed, record.slot, record.epoch, record.indices)
            self._send_worker(handle.routing_id, task)

    def _next_job(self) -> TaskRecord | None:
        """The next batch to decode: for the stream with the fewest batches in flight (the trainer
        closest to waiting: with DDP ranks sharing a pool smaller than their credits, the rank that is
        behind must not be starved by the prefetch of ranks blocked in an all-reduce); then the next
        epoch's first batches; warm-start batches last. Ties go round-robin."""
        self._rr.rotate(-1)
        wanting = [self._streams[key] for key in self._rr if self._streams[key].wants_batch()]
        for stream in sorted(wanting, key=lambda s: s.in_flight):
            if not stream.feed.pool.free:
                # NOTE [ Warm start ]: a trainer's batch goes before the cache
                self._free(stream.feed, self._warm[stream.feed.id].drop())
            if stream.feed.pool.free:
                return self._plan_batch(stream)
        for key in self._rr:
            stream = self._streams[key]
            if stream.ahead is not None and stream.wants_ahead() and stream.feed.pool.free:
                return self._plan_batch(stream.ahead)
        for warm in self._warm.values():
            if warm.wants_batch() and warm.feed.pool.free:
                return self._plan_batch(warm)
        return None

    def _plan_batch(self, stream: Stream | WarmCache) -> TaskRecord:
        slot = stream.feed.pool.acquire()
        assert slot is not None
        gen, seq, indices = stream.plan_batch()
        self._next_task += 1
        return TaskRecord(
            self._next_task,
            stream.feed.id,
            stream.key,
            gen,
            seq,
            stream.epoch,
            slot,
            indices.astype("<i8").tobytes(),
        )

    # --- status ---------------------------------------------------------------------------------

    def _report(self, now: float) -> None:
        """Watchdog pings while healthy; STATUS= and metrics about once a second."""
        if self._fatal is None and self._watchdog.due(now):
            self._watchdog.ping(now)
        if now - self._last_report < 1.0:
            return
        self._last_report = now
        systemd.status(self._summary())
        if self._metrics is not None:
            self._metrics.update(self.status())

    def _summary(self) -> str:
        """One line for systemd's STATUS= (``systemctl status``)."""
        feeds = "; ".join(
            f"{f.name}: {f.counters.decoded.rate():.0f} img/s, "
            f"{f.pool.counts()['leased']}/{len(f.pool)} slots leased"
            for f in self.feeds
        )
        return f"{len(self._sessions)} trainers; {feeds}"

    def _lag(self, session: Session) -> int:
        """Batches decoded for this trainer's stream that it has not taken yet."""
        stream = self._streams.get(session.stream_key())
        member = None if stream is None else stream.members.get(session.session_id)
        if stream is None or member is None or not member.active:
            return 0
        return max(0, stream.next_produce - stream.filling - member.next_send)

    def status(self) -> dict[str, object]:
        """A JSON-shaped snapshot, bounded so it always fits one frame."""
        sessions = [
            {
                "session": s.session_id,
                "client": s.client,
                "feed": self.feeds[s.feed].name,
                "mode": s.mode,
                "rank": s.rank,
                "world_size": s.world_size,
                "group": s.group if s.mode == "broadcast" else "",
                "epoch": s.epoch,
                "delivered": s.delivered,
                "leased": len(s.leases),
                "credits": s.credits,
                "lag": self._lag(s),
                "idle_seconds": round(time.monotonic() - s.last_seen, 1),
            }
            for s in list(self._sessions.values())[:STATUS_SESSIONS]
        ]
        workers = self._workers
        worker_list = (
            []
            if workers is None
            else [
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
        )
        return {
            "worker_list": worker_list[:STATUS_WORKERS],
            "uptime": round(time.monotonic() - self._started_at, 1),
            "feeds": [feed.status() for feed in self.feeds[:16]],
            "sessions": sessions,
            "attached": len(self._sessions),
            "workers": 0 if workers is None else sum(1 for _ in workers),
            "worker_restarts": 0 if workers is None else workers.restarts,
            "rejected_messages": self.rejected_messages,
        }
