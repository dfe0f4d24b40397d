"""The loader service's lifecycle: start-up, the main loop, shutdown.

The main thread runs one loop (NOTE [ Main loop ]); nothing else touches sockets or slot states.
What the loop dispatches to: ``trainers/`` (trainer messages and sessions, what goes to them),
``workers/`` (decode tasks, worker reports, their count), ``edges/`` (status, systemd, metrics).

NOTE [ Main loop ]
    Each turn, in this order: poll both sockets (at most ``TICK`` seconds); handle trainer messages
    (``TrainerDesk``); handle worker reports (``Scheduler``); react to a recorded signal (SIGHUP:
    re-read the authorised CURVE keys; SIGTERM/SIGINT: stop) or a fatal error; then, at most every
    ``HOUSEKEEPING`` seconds (or half a heartbeat interval, if that is shorter): kill workers stuck
    past the task timeout, reap and replace dead or lost ones, their tasks redone (NOTE [ Stuck
    workers ], NOTE [ Worker restarts ]); expire trainers whose heartbeats stopped and evict
    broadcast members that hold their group up; send heartbeats and whatever is owed (NOTE [ Owed
    messages ]); report to systemd and metrics. Last, every turn, hand tasks to idle workers.
    Signal handlers only record the signal, so shutdown always runs from here in a known state.

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

import functools
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import zmq

from loader_service.config import ServiceConfig
from loader_service.config.values import ByteSize
from loader_service.dataset.marks import SLOW_WALK
from loader_service.dataset.storage.cachedir import open_cache_folder
from loader_service.decode.contract import FAULT_ENV, THREAD_ENV, WorkerConfig
from loader_service.decode.decoders import describe_decoder
from loader_service.decode.progress import ProgressBoard
from loader_service.shm import LOCK_NAME, SHM_DIR, hold_lock, process_start, remove_stale
from loader_service.supervisor.edges import status, systemd
from loader_service.supervisor.edges.curve import CurveGuard
from loader_service.supervisor.edges.endpoint import bind_trainer_endpoint, recv_bounded, release_ipc_path
from loader_service.supervisor.edges.lifeline import Lifeline
from loader_service.supervisor.edges.metrics import ServiceMetrics
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.early import EarlyBatches
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.desk import TrainerDesk
from loader_service.supervisor.trainers.load import WorkerTime, measure
from loader_service.supervisor.trainers.outbox import Outbox
from loader_service.supervisor.trainers.sends import CopiedSend, SendBudget, send_copied
from loader_service.supervisor.workers.pool import WorkerSet, write_nothing_from_env
from loader_service.supervisor.workers.scheduler import Scheduler
from loader_service.supervisor.workers.sizing.controller import WorkerSizing
from protocol.codec import encode
from protocol.layout import SEGMENT_PREFIX
from protocol.messages import Message, ProtocolError
from protocol.workers import StopWorker

log = logging.getLogger(__name__)
TICK = 0.1
HOUSEKEEPING = 0.05
"""Seconds between the loop's checks of workers, sessions and heartbeats (at most: half the
heartbeat interval if that is shorter). Their deadlines are seconds with the defaults, and running
them on every turn cost the loop about a tenth of its time at thousands of batches a second
(``python -m benchmarks.loop_cost``)."""
STOP_GRACE = 5.0
Socket = zmq.Socket[bytes]


@dataclass(frozen=True)
class Serving:
    """What the main loop runs on, built together once the feeds, sockets and workers exist."""

    outbox: Outbox
    desk: TrainerDesk
    scheduler: Scheduler
    sizing: WorkerSizing


class LoaderService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.feeds: list[Feed] = []
        self._started_at = time.monotonic()
        self._signal: int | None = None
        self._reload = False
        """SIGHUP was received: re-read the authorised trainer keys."""
        self._guard: CurveGuard | None = None
        self._attached = Attachments()
        self._runtime_dir: Path | None = None
        self._runtime_lock: int | None = None
        self._cache_lock: int | None = None
        """Held while the service runs: the cache folder is one service's (NOTE [ Fetch cache ])."""
        self._ctx: zmq.Context[Socket] | None = None
        self._workers: WorkerSet | None = None
        self._owns_endpoint = False
        self._watchdog = systemd.Watchdog()
        self._metrics: ServiceMetrics | None = None
        self._last_report = 0.0
        self._worker_time = WorkerTime()
        """For the load a scaler reads (NOTE [ Fleet load ])."""
        self._next_housekeeping = 0.0
        self._progress: ProgressBoard | None = None
        self._serving: Serving | None = None
        """What the loop runs on, built whole once the feeds, sockets and workers are there."""

    # --- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; return the process exit code."""
        self._install_signal_handlers()
        try:
            self._start()
            self._loop()
        finally:
            self.shutdown()
        fatal = self._fatal()
        if fatal is not None:
            log.error("stopped: %s", fatal)
            return 1
        log.info("stopped cleanly")
        return 0

    def _install_signal_handlers(self) -> None:
        def record(signum: int, frame: FrameType | None) -> None:
            self._signal = signum

        def reload(signum: int, frame: FrameType | None) -> None:
            self._reload = True

        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)
        signal.signal(signal.SIGHUP, reload)

    def _start(self) -> None:
        cfg = self.config
        log.info("config: %s", cfg.summary())
        for path in remove_stale((SHM_DIR, Path(tempfile.gettempdir()))):
            log.warning("removed %s, left behind by a service that was killed", path)
        self._runtime_dir = Path(tempfile.mkdtemp(prefix=f"{SEGMENT_PREFIX}{os.getpid()}-"))
        self._runtime_lock = hold_lock(self._runtime_dir / LOCK_NAME)
        # Read by OpenCV when a worker or a pipeline probe imports it: refuse decompression bombs
        # before allocating. Set before the feeds open, since a pipeline feed's probe decodes.
        os.environ["OPENCV_IO_MAX_IMAGE_PIXELS"] = str(cfg.max_pixels)
        # One worker is one core: BLAS and OpenMP size their thread pools from these when a child
        # first imports numpy, which is before any worker code can set them.
        for name in THREAD_ENV:
            os.environ[name] = "1"
        if cfg.cache_dir and (lock := open_cache_folder(cfg.cache_dir, cfg.cache_size)) is not None:
            self._cache_lock = lock
        elif cfg.cache_dir:
            cfg = self.config = replace(cfg, cache_dir="", cache_size=ByteSize(0))
        # Re-read on SIGHUP: no path is relative once started (NOTE [ Nothing from the working folder ]).
        if cfg.curve_authorized:
            cfg = self.config = replace(cfg, curve_authorized=os.path.abspath(cfg.curve_authorized))
        for feed_id, feed_config in enumerate(cfg.feeds()):
            self.feeds.append(
                Feed.open(
                    feed_id, feed_config, self._runtime_dir, cfg.group, cfg.task_timeout, cfg.worker_processes
                )
            )
        self._ctx = zmq.Context()
        self._frontend, self._guard = bind_trainer_endpoint(self._ctx, cfg)
        self._owns_endpoint = True
        backend_endpoint = f"ipc://{self._runtime_dir}/workers.sock"
        self._backend = self._ctx.socket(zmq.ROUTER)
        self._backend.setsockopt(zmq.LINGER, 0)
        self._backend.bind(backend_endpoint)
        # NOTE [ Per-sample progress ]: made before any worker maps it, removed with the folder.
        self._progress = ProgressBoard(self._runtime_dir / "progress", cfg.worker_processes, create=True)
        self._workers = WorkerSet(
            self._worker_template(backend_endpoint),
            cfg.worker_processes,
            active=cfg.first_workers,
            folder=self._runtime_dir,  # NOTE [ Nothing from the working folder ]
        )
        log.info("decoder: %s", describe_decoder(cfg.decoder))
        if SLOW_WALK and any(len(feed.sources.names) > 1 for feed in self.feeds):
            log.warning("%s", SLOW_WALK)
        self._start_metrics()
        self._serving = self._serve(self._workers, self._progress)
        for feed in self.feeds:
            self._log_ready(feed)
        systemd.ready(status.summary(self.feeds, self._attached))

    def _start_metrics(self) -> None:
        cfg = self.config
        if cfg.metrics_port:
            self._metrics = ServiceMetrics()
            self._metrics.start(cfg.metrics_port, cfg.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", cfg.metrics_addr, cfg.metrics_port)

    def _serve(self, workers: WorkerSet, progress: ProgressBoard) -> Serving:
        """The loop's parts, each built whole from the feeds, the workers and the metrics."""
        cfg, feeds = self.config, tuple(self.feeds)
        warm = {feed.id: EarlyBatches(feed) for feed in feeds}
        sends = SendBudget(sum(feed.segment.size for feed in feeds))  # NOTE [ Remote sends ]
        observe = None if self._metrics is None else self._metrics.observe_ready_wait
        send_frames = functools.partial(self._send_frames, sends)
        outbox = Outbox(self._send, send_frames, self._attached, cfg.heartbeat_interval, sends, observe)
        desk = TrainerDesk(cfg, feeds, warm, self._attached, outbox, self.status)
        scheduler = Scheduler(cfg, workers, self._attached, warm, self._send_worker, outbox.deliver, progress)
        return Serving(outbox, desk, scheduler, WorkerSizing(cfg, workers))

    def _log_ready(self, feed: Feed) -> None:
        log.info(
            "ready: feed %r, %d samples (%s) in %d classes, %d batches/epoch of %d, "
            "pool %d of at most %d slots x %.1f MiB (%s), listening on %s",
            feed.name,
            len(feed.sources),
            feed.sources.kind,
            feed.sources.num_classes,
            feed.shard_batches(1, "pad"),
            feed.config.batch_size,
            len(feed.pool),
            feed.pool.capacity,
            feed.layout.stride / 2**20,
            feed.segment.name,
            self.config.endpoint,
        )

    def _worker_template(self, backend: str) -> WorkerConfig:
        """Every decode worker's config, replacements included."""
        return WorkerConfig(
            worker=0,
            parent_pid=os.getpid(),
            parent_start=process_start(os.getpid()),
            backend=backend,
            feeds=tuple(feed.worker_feed() for feed in self.feeds),
            log_level=self.config.log_level,
            roi=self.config.roi,
            write_nothing=write_nothing_from_env(),
            progress=str(self._progress.path) if self._progress else "",
            workers=self.config.worker_processes,
        )

    def shutdown(self) -> None:
        """NOTE [ Shutdown order ] steps 2-4; safe to call on a partly started service."""
        if self._workers is not None:
            for h in self._workers:
                if h.routing_id is not None:
                    self._send_worker(h.routing_id, StopWorker())
            self._workers.join(time.monotonic() + STOP_GRACE)
            self._workers = None
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        for feed in self.feeds:
            feed.close()
        self.feeds.clear()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
        if self._runtime_lock is not None:
            os.close(self._runtime_lock)
            self._runtime_lock = None
        if self._cache_lock is not None:
            os.close(self._cache_lock)
            self._cache_lock = None
        if self._owns_endpoint:
            release_ipc_path(self.config.endpoint)
            self._owns_endpoint = False
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None

    # --- the loop -------------------------------------------------------------------------------

    def _fatal(self) -> str | None:
        return None if self._serving is None else self._serving.scheduler.fatal

    def _loop(self) -> None:
        serving = self._serving
        assert serving is not None
        scheduler = serving.scheduler
        poller = zmq.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._backend, zmq.POLLIN)
        lifeline = Lifeline() if self.config.stop_with_stdin else None
        if lifeline is not None:
            poller.register(lifeline.fd, zmq.POLLIN)
        if os.environ.get(FAULT_ENV) == "main-loop":
            raise RuntimeError(f"fault injected by {FAULT_ENV}")
        housekeeping = min(HOUSEKEEPING, self.config.heartbeat_interval / 2)
        while True:
            events = dict(poller.poll(int(TICK * 1000)))
            if self._frontend in events:
                self._drain(self._frontend, serving.desk.on_frames)
            if self._backend in events:
                self._drain(self._backend, scheduler.on_frames)
            if self._reload:
                self._reload = False
                if self._guard is not None:
                    self._guard.keys.reload()
            if self._signal is not None:
                log.info("received %s; shutting down", signal.Signals(self._signal).name)
                systemd.stopping()
                return
            if lifeline is not None and lifeline.fd in events and lifeline.cut():
                log.info("standard input closed: whoever started the service is gone; shutting down")
                systemd.stopping()
                return
            if scheduler.fatal is not None:
                return
            now = time.monotonic()
            if now >= self._next_housekeeping:
                self._next_housekeeping = now + housekeeping
                self._housekeeping(serving, now)
            scheduler.schedule()

    def _housekeeping(self, serving: Serving, now: float) -> None:
        """Replace dead workers, reclaim silent trainers, note who waits, send heartbeats, report."""
        serving.scheduler.reap()
        serving.desk.expire(now)
        serving.desk.evict_laggards(now)
        self._attached.watch_waits(now)
        for feed in self.feeds:  # NOTE [ Giving slots back ]: after twice the client timeout
            feed.pool.give_back(now, self._attached.pinned_through(feed.id), 2 * self.config.client_timeout)
        serving.outbox.heartbeat(now)
        self._report(serving, now)

    @staticmethod
    def _drain(sock: Socket, handle: Callable[[list[bytes]], None]) -> None:
        # Bounded so that a flood on one socket cannot starve the other or the signal check.
        for _ in range(1000):
            try:
                frames = recv_bounded(sock)
            except zmq.Again:
                return
            handle(frames)

    def _send(self, routing_id: bytes, msg: Message) -> bool:
        """Send to a trainer without ever blocking the loop; False if the message did not go out."""
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

    def _send_frames(
        self, sends: SendBudget, routing_id: bytes, msg: Message, frames: list[memoryview]
    ) -> CopiedSend | None:
        """Send ``msg`` and copies of a slot's views to a remote trainer (NOTE [ Remote sends ]);
        None if nothing went out."""
        try:
            return send_copied(self._frontend, routing_id, encode(msg), frames, sends)
        except zmq.ZMQError as exc:
            log.debug("could not send %s to %r: %s", msg.KIND, routing_id, exc)
            return None

    def _send_worker(self, routing_id: bytes, msg: Message) -> None:
        try:
            self._backend.send_multipart([routing_id, encode(msg)], zmq.NOBLOCK)
        except (zmq.ZMQError, ProtocolError) as exc:
            log.debug("could not reach worker: %s", exc)

    # --- status ---------------------------------------------------------------------------------

    def _report(self, serving: Serving, now: float) -> None:
        """Watchdog pings while healthy; STATUS= and metrics about once a second."""
        if self._fatal() is None and self._watchdog.due(now):
            self._watchdog.ping(now)
        serving.sizing.tick(now, self.feeds, self._attached.sessions.values())
        if now - self._last_report < 1.0:
            return
        self._last_report = now
        if self._workers is not None:
            self._worker_time.sample(now, self._workers.busy_seconds(now), self._workers.active)
        systemd.status(status.summary(self.feeds, self._attached))
        if self._metrics is not None:
            self._metrics.update(self.status())

    def status(self) -> dict[str, object]:
        """A JSON-shaped snapshot, bounded so it always fits one frame (asked once serving)."""
        serving = self._serving
        assert serving is not None
        outbox = serving.outbox
        outbox.sends.settle()
        sending = outbox.sends.held + outbox.sends.orphaned  # NOTE [ Remote sends ]
        load = measure(self._worker_time, (s.loop for s in self._attached.sessions.values()))
        body = status.snapshot(
            self.feeds,
            self._attached,
            self._workers,
            self._started_at,
            outbox.rejected_messages,
            serving.sizing.status(),
            sending,
            load,
        )
        return body
