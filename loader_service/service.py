"""The loader service process: one feed, its slot pool, its decode workers and the trainer endpoint.

The main thread runs one loop (NOTE [ Main loop ]); nothing else touches sockets or slot states.

NOTE [ Main loop ]
    Each turn, in this order: poll both sockets (at most ``TICK`` seconds); handle trainer messages;
    handle worker reports; react to a recorded signal; reap and replace dead workers (their tasks are
    redone); expire trainers whose heartbeats stopped; send heartbeats; hand tasks to idle workers.
    Signal handlers only record the signal, so shutdown always runs from here in a known state.

NOTE [ Shutdown order ]
    1. Stop scheduling: no new task is handed out once a stop signal is recorded.
    2. Send ``stop`` to every worker and join them (``STOP_GRACE`` seconds), then terminate, then kill:
       no worker outlives the service or writes into a pool that is going away.
    3. Close the sockets with linger 0 and terminate the ZeroMQ context, so exit never hangs on peers.
       Trainers notice the silence through their heartbeat timeout.
    4. Unmap and unlink the shared-memory segment (NOTE [ Shared-memory cleanup ]), then remove the
       private runtime directory (worker socket, index files).
    Steps 2-4 run from ``finally``, so an exception during start-up or in the loop cleans up too.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import zmq

from loader_service.config import ServiceConfig
from loader_service.index import DatasetIndex, build_index
from loader_service.sampler import batch_indices, batches_per_epoch
from loader_service.sessions import Session
from loader_service.shm import Segment, new_segment_name
from loader_service.slots import SlotPool
from loader_service.worker import WorkerConfig
from loader_service.workers import WorkerSet
from protocol.layout import SlotLayout
from protocol.messages import (
    MAX_FRAME_BYTES,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    FeedInfo,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Start,
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
TRAINER_MESSAGES = (Hello, Start, Release, Heartbeat, Bye)
WORKER_MESSAGES = (WorkerReady, TaskDone)


class EndpointInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class TaskRecord:
    task: int
    session_id: str
    run: int
    epoch: int
    seq: int
    slot: int
    indices: bytes


@dataclass
class Stats:
    decoded: int = 0
    batches: int = 0
    bad_files: int = 0
    rejected_messages: int = 0


class LoaderService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.layout = SlotLayout(config.batch_size, config.image_size)
        self.stats = Stats()
        self.bad_files: dict[int, str] = {}
        self._signal: int | None = None
        self._sessions: dict[bytes, Session] = {}
        self._by_session_id: dict[str, bytes] = {}
        self._tasks: dict[int, TaskRecord] = {}
        self._redo: deque[TaskRecord] = deque()
        self._next_task = 0
        self._next_lease = 0
        self._rr: deque[bytes] = deque()
        self._last_heartbeat = 0.0
        self._runtime_dir: Path | None = None
        self._segment: Segment | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._workers: WorkerSet | None = None
        self.index: DatasetIndex | None = None
        self._owns_endpoint = False

    # --- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; return the process exit code."""
        self._install_signal_handlers()
        try:
            self._start()
            self._loop()
        finally:
            self.shutdown()
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
        self.index = build_index(cfg.data, progress=lambda n: log.info("indexing: %d files so far", n))
        self.pool = SlotPool(cfg.pool_slots)
        self.batches_per_epoch = batches_per_epoch(len(self.index), cfg.batch_size)
        self._runtime_dir = Path(tempfile.mkdtemp(prefix="dataferry-"))
        self.index.save(self._runtime_dir)
        self._segment = Segment.create(new_segment_name(cfg.feed), self.layout.segment_bytes(cfg.pool_slots))
        self._ctx = zmq.Context()
        self._frontend = self._bind_frontend(self._ctx)
        backend_endpoint = f"ipc://{self._runtime_dir}/workers.sock"
        self._backend = self._ctx.socket(zmq.ROUTER)
        self._backend.setsockopt(zmq.LINGER, 0)
        self._backend.bind(backend_endpoint)
        self._workers = WorkerSet(self._worker_template(backend_endpoint), cfg.workers)
        self.feed_info = self._feed_info()
        log.info(
            "ready: feed %r, %d samples in %d classes, %d batches/epoch of %d, "
            "pool %d slots x %.1f MiB (%s), listening on %s",
            cfg.feed,
            len(self.index),
            len(self.index.classes),
            self.batches_per_epoch,
            cfg.batch_size,
            cfg.pool_slots,
            self.layout.stride / 2**20,
            self._segment.name,
            cfg.endpoint,
        )

    def _bind_frontend(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        _claim_ipc_path(self.config.endpoint)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.bind(self.config.endpoint)
        self._owns_endpoint = True
        return sock

    def _worker_template(self, backend: str) -> WorkerConfig:
        assert self._segment is not None and self._runtime_dir is not None
        cfg = self.config
        return WorkerConfig(
            worker=0,
            parent_pid=os.getpid(),
            backend=backend,
            segment=self._segment.name,
            slots=cfg.pool_slots,
            layout=self.layout,
            index_dir=self._runtime_dir,
            data=cfg.data,
            seed=cfg.seed,
            augment=cfg.augment,
            log_level=cfg.log_level,
        )

    def _feed_info(self) -> FeedInfo:
        assert self.index is not None and self._segment is not None
        cfg = self.config
        return FeedInfo(
            name=cfg.feed,
            samples=len(self.index),
            classes=len(self.index.classes),
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            batches_per_epoch=self.batches_per_epoch,
            seed=cfg.seed,
            augment=cfg.augment,
            fingerprint=self.index.fingerprint(),
            segment=self._segment.name,
            slots=cfg.pool_slots,
        )

    def request_stop(self) -> None:
        self._signal = signal.SIGTERM

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
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
        if self._owns_endpoint:
            _release_ipc_path(self.config.endpoint)
            self._owns_endpoint = False

    # --- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._backend, zmq.POLLIN)
        while True:
            events = dict(poller.poll(int(TICK * 1000)))
            if self._frontend in events:
                self._drain(self._frontend, self._on_trainer_frames)
            if self._backend in events:
                self._drain(self._backend, self._on_worker_frames)
            if self._signal is not None:
                log.info("received %s; shutting down", signal.Signals(self._signal).name)
                return
            self._reap_workers()
            now = time.monotonic()
            self._expire_sessions(now)
            self._send_heartbeats(now)
            self._schedule()

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
        if isinstance(msg, Start):
            self._on_start(session, msg)
        elif isinstance(msg, Release):
            self._on_release(session, msg)
        elif isinstance(msg, Bye):
            self._drop_session(session, "said bye")

    def _on_hello(self, routing_id: bytes, msg: Hello) -> None:
        if msg.feed not in ("", self.config.feed):
            self._reject(
                routing_id, "no-such-feed", f"this service serves feed {self.config.feed!r}, not {msg.feed!r}"
            )
            return
        old = self._sessions.get(routing_id)
        if old is not None:
            self._drop_session(old, "said hello again")
        session = Session(routing_id, secrets.token_hex(8), msg.client, msg.credits, time.monotonic())
        self._sessions[routing_id] = session
        self._by_session_id[session.session_id] = routing_id
        self._rr.append(routing_id)
        log.info("trainer %s (pid %d) attached as session %s", msg.client, msg.pid, session.session_id)
        self._send(
            session.routing_id, Welcome(session.session_id, self.feed_info, self.config.heartbeat_interval)
        )

    def _session_by_id(self, session_id: str) -> Session | None:
        routing_id = self._by_session_id.get(session_id)
        return None if routing_id is None else self._sessions.get(routing_id)

    def _on_start(self, session: Session, msg: Start) -> None:
        self._cancel_unsent(session)
        session.begin(msg.run, msg.epoch, msg.position, self.batches_per_epoch)
        self._maybe_end(session)

    def _on_release(self, session: Session, msg: Release) -> None:
        unknown = 0
        for lease in msg.leases:
            slot = session.leases.pop(lease, None)
            if slot is None:
                unknown += 1
            else:
                self.pool.release(slot)
        if unknown:
            self.stats.rejected_messages += 1
            log.warning(
                "session %s released %d leases it does not hold; ignored", session.session_id, unknown
            )

    def _cancel_unsent(self, session: Session) -> None:
        """Free READY slots of the session's current run; FILLING ones are freed when their task reports."""
        for slot, _count in session.ready.values():
            self.pool.release(slot)
        session.ready.clear()

    def _drop_session(self, session: Session, why: str) -> None:
        """Return every slot the session holds (NOTE [ Slot lifecycle ]: cancel and lease expiry)."""
        self._cancel_unsent(session)
        for slot in session.leases.values():
            self.pool.release(slot)
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
        self._rr.remove(session.routing_id)

    def _expire_sessions(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if now - session.last_seen > self.config.client_timeout:
                self._drop_session(session, f"no heartbeat for {self.config.client_timeout:.0f} s")

    def _send_heartbeats(self, now: float) -> None:
        if now - self._last_heartbeat < self.config.heartbeat_interval:
            return
        self._last_heartbeat = now
        for routing_id in list(self._sessions):
            self._send(routing_id, Heartbeat())

    def _deliver(self, session: Session) -> None:
        """Announce finished batches strictly in sequence order."""
        while session.next_send in session.ready:
            slot, count = session.ready.pop(session.next_send)
            lease = self._next_lease
            self._next_lease += 1
            self.pool.lease(slot)
            session.leases[lease] = slot
            self._send(
                session.routing_id,
                BatchReady(session.run, session.epoch, session.next_send, lease, slot, count),
            )
            session.next_send += 1
            session.delivered += 1
            self.stats.batches += 1
        self._maybe_end(session)

    def _maybe_end(self, session: Session) -> None:
        if not session.end_sent and session.next_send >= session.end:
            session.end_sent = True
            self._send(session.routing_id, EpochEnd(session.run, session.epoch, session.end))

    def _send(self, routing_id: bytes, msg: Message) -> None:
        try:
            self._frontend.send_multipart([routing_id, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Unreachable (gone) or full peer: never block the loop. A session that is really gone is
            # reclaimed by its heartbeat timeout, never sooner, so a trainer's mapped slots stay valid.
            log.debug("could not send %s to %r: %s", msg.KIND, routing_id, exc)

    def _reject(self, routing_id: bytes, code: str, message: str, fatal: bool = False) -> None:
        self.stats.rejected_messages += 1
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
                handle.routing_id = frames[0]
        elif isinstance(msg, TaskDone):
            self._on_task_done(msg)

    def _on_task_done(self, msg: TaskDone) -> None:
        assert self._workers is not None
        handle = self._workers.get(msg.worker)
        if handle is not None and handle.task == msg.task:
            handle.task = None
        record = self._tasks.pop(msg.task, None)
        if record is None:
            return
        self._note_bad_files(msg)
        self.stats.decoded += msg.count
        session = self._session_by_id(record.session_id)
        if session is None or session.run != record.run:
            self.pool.release(record.slot)  # cancelled while filling
            return
        session.filling -= 1
        self.pool.filled(record.slot)
        session.ready[record.seq] = (record.slot, msg.count)
        self._deliver(session)

    def _note_bad_files(self, msg: TaskDone) -> None:
        assert self.index is not None
        for idx, reason in msg.bad:
            self.stats.bad_files += 1
            if idx not in self.bad_files and 0 <= idx < len(self.index):
                self.bad_files[idx] = reason
                log.warning("bad file skipped: %s: %s", self.index.relpath(idx), reason)

    def _reap_workers(self) -> None:
        assert self._workers is not None
        for dead in self._workers.reap():
            record = self._tasks.pop(dead.task, None) if dead.task is not None else None
            if record is not None:
                # The slot stays FILLING and is rewritten from scratch by whoever takes the redo. A fresh
                # task id makes a late ``done`` from the dead worker unrecognisable, so the slot can never
                # be announced while the redo is still writing it.
                self._next_task += 1
                self._redo.append(replace(record, task=self._next_task))

    def _send_worker(self, routing_id: bytes, msg: Message) -> None:
        try:
            self._backend.send_multipart([routing_id, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not reach worker: %s", exc)

    def _schedule(self) -> None:
        assert self._workers is not None
        for handle in self._workers.idle():
            record = self._redo.popleft() if self._redo else self._next_job()
            if record is None:
                return
            assert handle.routing_id is not None
            handle.task = record.task
            self._tasks[record.task] = record
            self._send_worker(handle.routing_id, Task(record.task, record.slot, record.epoch, record.indices))

    def _next_job(self) -> TaskRecord | None:
        """Round-robin over sessions that have credit left, one batch each turn."""
        if self.pool.free == 0:
            return None
        for _ in range(len(self._rr)):
            routing_id = self._rr[0]
            self._rr.rotate(-1)
            session = self._sessions[routing_id]
            if session.wants_batch():
                return self._plan_batch(session)
        return None

    def _plan_batch(self, session: Session) -> TaskRecord:
        assert self.index is not None
        slot = self.pool.acquire()
        assert slot is not None
        seq = session.next_produce
        session.next_produce += 1
        session.filling += 1
        indices = batch_indices(self.config.seed, session.epoch, len(self.index), self.config.batch_size, seq)
        self._next_task += 1
        return TaskRecord(
            self._next_task,
            session.session_id,
            session.run,
            session.epoch,
            seq,
            slot,
            indices.astype("<i8").tobytes(),
        )


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def _claim_ipc_path(endpoint: str) -> None:
    """Refuse an ipc endpoint another live service listens on; remove a stale socket file.

    A second ZeroMQ bind to the same path silently steals it from the first service.
    """
    path = _ipc_path(endpoint)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left behind by a service that died
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise EndpointInUse(f"another process is already listening on {endpoint}")


def _release_ipc_path(endpoint: str) -> None:
    path = _ipc_path(endpoint)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
