"""``ServiceLoader``: a drop-in for a DataLoader loop, fed by a running loader service.

    with ServiceLoader("ipc:///run/dataferry/train.sock", device="auto") as loader:
        for epoch in range(10):
            for images, labels in loader:
                ...

Threads: the iterating thread owns the main socket (hello, start, release, batches); a small daemon
thread owns a second socket and only sends heartbeats, so a long training step never looks like a
dead trainer. Slot leases are returned by ``weakref.finalize`` callbacks that only append to a deque
(they may run on any thread); the iterating thread sends the releases.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
import zmq

from gpu_worker.device import CudaStager, resolve_device
from gpu_worker.mapping import SlotMap
from protocol.layout import SlotLayout
from protocol.messages import (
    MAX_RELEASES,
    MODES,
    REMAINDERS,
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
    Welcome,
    decode,
    encode,
)

log = logging.getLogger(__name__)
SERVICE_MESSAGES = (Welcome, BatchReady, EpochEnd, Heartbeat, ErrorReply)
POLL_SLICE = 0.1


class ServiceError(RuntimeError):
    """The service refused the trainer, or answered with something it should not have."""


class ServiceTimeout(ServiceError, TimeoutError):
    """No answer in time; the message says what was awaited and what the trainer still holds."""


class Batch:
    """One delivered batch. Unpacks as ``images, labels`` like a DataLoader batch.

    ``images``: uint8 ``[n, 3, S, S]``; ``labels`` and ``indices`` (positions in the service's dataset
    index): int64 ``[n]``. On CPU, ``images`` views shared memory; its slot is returned to the service
    when the last tensor viewing it is freed.
    """

    __slots__ = ("epoch", "images", "indices", "labels", "seq")

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, epoch: int, seq: int
    ):
        self.images = images
        self.labels = labels
        self.indices = indices
        self.epoch = epoch
        self.seq = seq

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.images, self.labels))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.images, self.labels)[i]

    def __repr__(self) -> str:
        return f"Batch(epoch={self.epoch}, seq={self.seq}, images={tuple(self.images.shape)})"


@dataclass(frozen=True)
class LoaderConfig:
    """Everything a ``ServiceLoader`` is asked for, validated once."""

    endpoint: str
    device: str = "cpu"
    feed: str = ""
    credits: int = 6
    timeout: float = 60.0
    connect_timeout: float = 30.0
    mode: str = "shard"
    rank: int = 0
    world_size: int = 1
    remainder: str = "pad"
    group: str = "default"
    group_size: int = 1
    batch_size: int = 0
    image_size: int = 0

    def validated(self) -> LoaderConfig:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        if not 2 <= self.credits <= 1024:
            raise ValueError(
                "credits must be between 2 and 1024 (a loop holds one batch while fetching the next)"
            )
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {', '.join(REMAINDERS)}, got {self.remainder!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 1 <= self.group_size <= 1024 or not self.group or len(self.group) > 64:
            raise ValueError("group must be a name of 1 to 64 characters and group_size 1 to 1024")
        return self


def _env_int(name: str, default: int) -> int:
    """torchrun's RANK / WORLD_SIZE, when set."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class ServiceLoader:
    """Attach to a loader service feed; iterate once per epoch. See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        device: str = "cpu",
        feed: str = "",
        mode: str = "shard",
        rank: int | None = None,
        world_size: int | None = None,
        remainder: str = "pad",
        group: str = "default",
        group_size: int = 1,
        batch_size: int | None = None,
        image_size: int | None = None,
        credits: int = 6,
        timeout: float = 60.0,
        connect_timeout: float = 30.0,
    ) -> None:
        shard = mode == "shard"
        self.config = LoaderConfig(
            endpoint,
            device,
            feed,
            credits,
            timeout,
            connect_timeout,
            mode,
            (_env_int("RANK", 0) if rank is None else rank) if shard else 0,
            (_env_int("WORLD_SIZE", 1) if world_size is None else world_size) if shard else 1,
            remainder,
            group,
            group_size,
            batch_size or 0,
            image_size or 0,
        ).validated()
        self.device = resolve_device(device)
        self._resume: tuple[int, int] | None = None
        self._position = 0
        self._current_epoch: int | None = None
        self._released: deque[int] = deque()
        self._inbox: deque[Message] = deque()
        self._live: set[int] = set()
        self._run = 0
        self._next_epoch = 0
        self._closed = False
        self._last_heard = time.monotonic()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        self._sock.connect(endpoint)
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._stager: CudaStager | None = None
        self._slots: SlotMap | None = None
        try:
            self.info, interval, self._batches = self._attach()
            self._slots = SlotMap(
                self.info.segment, SlotLayout(self.info.batch_size, self.info.image_size), self.info.slots
            )
            self._start_heartbeat(interval)
            if self.device.type == "cuda":
                self._stager = CudaStager(self.device)
                self._stager.pin(self._slots.address, self._slots.nbytes)
        except BaseException:
            self.close()
            raise

    # --- public API -----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch for this trainer (its shard's share in shard mode)."""
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` delivers (like DistributedSampler.set_epoch)."""
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        self._next_epoch = epoch
        self._resume = None

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise ServiceError("this ServiceLoader is closed")
        epoch, position = self._resume or (self._next_epoch, 0)
        self._resume = None
        self._next_epoch = epoch + 1
        return self._epoch(epoch, position)

    def state_dict(self) -> dict[str, Any]:
        """Where this trainer is: JSON-serialisable, small; ``load_state_dict`` continues from here.

        ``position`` counts the batches of ``epoch`` already handed to the training loop, so a
        checkpoint taken after a step resumes with the next batch.
        """
        if self._resume is not None:
            epoch, position = self._resume
        elif self._current_epoch is not None and self._position < self._batches:
            epoch, position = self._current_epoch, self._position
        else:
            epoch, position = self._next_epoch, 0
        return {
            "version": 1,
            "epoch": epoch,
            "position": position,
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``; refuse a state from another feed or setup."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not a ServiceLoader state (missing or unknown 'version')")
        mismatched = [
            f"{key}: state has {state.get(key)!r}, this loader {mine!r}"
            for key, mine in self._identity().items()
            if state.get(key) != mine
        ]
        if mismatched:
            raise ValueError("state belongs to a different feed or setup: " + "; ".join(mismatched))
        epoch, position = state.get("epoch"), state.get("position")
        if (
            type(epoch) is not int
            or type(position) is not int
            or epoch < 0
            or not 0 <= position <= self._batches
        ):
            raise ValueError(f"state has an invalid epoch/position: {epoch!r}/{position!r}")
        self._resume = (epoch, position)
        self._next_epoch = epoch

    def _identity(self) -> dict[str, Any]:
        """What must match for a state to be valid here: the same data, order and shard."""
        cfg = self.config
        return {
            "feed": self.info.name,
            "fingerprint": self.info.fingerprint,
            "seed": self.info.seed,
            "batch_size": self.info.batch_size,
            "mode": cfg.mode,
            "rank": cfg.rank,
            "world_size": cfg.world_size,
            "remainder": cfg.remainder,
        }

    def __enter__(self) -> ServiceLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Leave the service. Batches still held must not be used afterwards: their slots are reused."""
        if self._closed:
            return
        self._closed = True
        if self._live - set(self._released):
            log.warning("closing with %d batches still referenced", len(self._live - set(self._released)))
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(2.0)
        if self._stager is not None:
            self._stager.close()
        if hasattr(self, "info"):
            self._try_send(Bye())
        if self._slots is not None:
            self._slots.close()
        self._sock.close(linger=0)
        self._ctx.term()

    # --- session --------------------------------------------------------------------------------

    def _attach(self) -> tuple[FeedInfo, float, int]:
        cfg = self.config
        hello = Hello(
            client=f"{socket.gethostname()}:{os.getpid()}"[:128],
            pid=os.getpid(),
            feed=cfg.feed,
            credits=cfg.credits,
            mode=cfg.mode,
            rank=cfg.rank,
            world_size=cfg.world_size,
            remainder=cfg.remainder,
            group=cfg.group,
            group_size=cfg.group_size,
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
        )
        self._sock.send(encode(hello))
        deadline = time.monotonic() + cfg.connect_timeout
        while True:
            msg = self._recv(deadline)
            if msg is None:
                raise ServiceTimeout(
                    f"no loader service answered at {cfg.endpoint} within {cfg.connect_timeout:.0f} s "
                    "(is `loader-service serve` running there?)"
                )
            if isinstance(msg, Welcome):
                self._session = msg.session
                return msg.feed, msg.heartbeat_interval, msg.batches

    def _start_heartbeat(self, interval: float) -> None:
        self._heartbeat = threading.Thread(
            target=_heartbeat_loop,
            args=(self._ctx, self.config.endpoint, self._session, interval, self._stop_heartbeat),
            name="dataferry-heartbeat",
            daemon=True,
        )
        self._heartbeat.start()

    def _recv(self, deadline: float) -> Message | None:
        """Next message from the service, or None at ``deadline``; sends pending releases meanwhile.

        Whatever else has already arrived is read too, so that a fatal error (eviction, refusal)
        queued behind batches is raised now, instead of handing out batches the service disowned.
        """
        while True:
            if self._stager is not None:
                self._stager.collect()
            self._flush_releases()
            if self._inbox:
                return self._inbox.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._sock.poll(int(min(remaining, POLL_SLICE) * 1000) + 1):
                self._read_available()

    def _read_available(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decode(frame)
            self._last_heard = time.monotonic()
            if isinstance(msg, ErrorReply):
                self._on_error(msg)
            else:
                self._inbox.append(msg)

    @staticmethod
    def _decode(frame: bytes) -> Message:
        try:
            return decode(frame, SERVICE_MESSAGES)
        except ProtocolError as exc:
            raise ServiceError(f"malformed message from the service: {exc}") from None

    def _on_error(self, msg: ErrorReply) -> None:
        if msg.fatal or not hasattr(self, "info"):
            raise ServiceError(f"service refused: {msg.message} ({msg.code})")
        log.warning("service reported: %s (%s)", msg.message, msg.code)

    # --- delivery -------------------------------------------------------------------------------

    def _epoch(self, epoch: int, position: int) -> Iterator[Batch]:
        self._run += 1
        run = self._run
        self._current_epoch, self._position = epoch, position
        self._sock.send(encode(Start(run, epoch, position)))
        while True:
            msg = self._next_for(run)
            if isinstance(msg, EpochEnd):
                self._position = self._batches
                return
            batch = self._wrap(msg)
            self._position = msg.seq + 1
            if batch is not None:
                yield batch
            del batch  # the generator must not keep the previous batch's slot while waiting

    def _next_for(self, run: int) -> BatchReady | EpochEnd:
        """Wait for this run's next batch or its end; batches of abandoned runs are released unread."""
        self._check_not_starved()
        deadline = time.monotonic() + self.config.timeout
        while True:
            msg = self._recv(deadline)
            if msg is None:
                raise self._timeout_error()
            if isinstance(msg, (BatchReady, EpochEnd)) and msg.run == run:
                return msg
            if isinstance(msg, BatchReady):
                self._released.append(msg.lease)

    def _held(self) -> int:
        return len(self._live) - len(self._released)

    def _check_not_starved(self) -> None:
        """Fail at once, not after the timeout, when held batches use up every credit (CPU zero-copy)."""
        if self._stager is not None or self._held() < self.config.credits:
            return
        gc.collect()  # batches in unreachable cycles still pin their slots until collected
        if self._held() >= self.config.credits:
            raise ServiceError(
                f"this trainer still references all {self.config.credits} batches its credits allow, so the "
                "service cannot send another: drop references to old batches (keep .clone() copies if "
                "needed), or pass a larger credits= to ServiceLoader"
            )

    def _timeout_error(self) -> ServiceTimeout:
        silent = time.monotonic() - self._last_heard
        held = self._held()
        if silent > self.config.timeout / 2:
            why = f"the service at {self.config.endpoint} has been silent for {silent:.0f} s"
        else:
            why = f"the service is alive but sent nothing; this trainer holds {held} of {self.config.credits}"
        return ServiceTimeout(f"no batch within {self.config.timeout:.0f} s: {why}")

    def _wrap(self, msg: BatchReady) -> Batch | None:
        assert self._slots is not None
        if msg.count == 0 or msg.count > self.info.batch_size:
            self._released.append(msg.lease)  # every file of the batch was bad
            return None
        layout = self._slots.layout
        try:
            owner = self._slots.slot(msg.slot)
        except ValueError as exc:
            raise ServiceError(f"service announced an invalid slot: {exc}") from None
        self._live.add(msg.lease)
        # NOTE [ Slot lifecycle ]: the lease ends when ``owner`` dies, i.e. with the last view of it.
        fin = weakref.finalize(owner, self._released.append, msg.lease)
        fin.atexit = False
        view = memoryview(owner)  # numpy keeps view.obj, i.e. ``owner``, as its base
        pixels = np.frombuffer(view, np.uint8, msg.count * layout.image_bytes, 0)
        images = torch.from_numpy(pixels.reshape(msg.count, *layout.image_shape))
        labels = torch.from_numpy(np.frombuffer(view, np.int64, msg.count, layout.labels_offset).copy())
        indices = torch.from_numpy(np.frombuffer(view, np.int64, msg.count, layout.indices_offset).copy())
        del owner, view
        if self._stager is not None:
            images, labels = self._stager.stage(images, labels, keep_alive=images)
        return Batch(images, labels, indices, msg.epoch, msg.seq)

    def _flush_releases(self) -> None:
        if not self._released:
            return
        while self._released:
            leases: list[int] = []
            while self._released and len(leases) < MAX_RELEASES:
                lease = self._released.popleft()
                self._live.discard(lease)
                leases.append(lease)
            self._try_send(Release(tuple(leases)))

    def _try_send(self, msg: Message) -> None:
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not send %s: %s", msg.KIND, exc)


def _heartbeat_loop(
    ctx: zmq.Context[Any], endpoint: str, session: str, interval: float, stop: threading.Event
) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    frame = encode(Heartbeat(session))
    try:
        while not stop.wait(interval):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close(linger=0)
