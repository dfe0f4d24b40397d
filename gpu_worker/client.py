"""``ServiceLoader``: a drop-in for a DataLoader loop, fed by a running loader service.

    with ServiceLoader("ipc:///run/dataferry/train.sock", device="auto") as loader:
        for epoch in range(10):
            for images, labels in loader:
                ...

The session itself (sockets, heartbeats, loss detection) is ``gpu_worker.connection``. Slot leases
are returned by ``weakref.finalize`` callbacks that only append to a deque (they may run on any
thread); the iterating thread sends the releases.

NOTE [ Reconnecting ]
    When the service restarts (it answers ``no-session``) or goes silent for several heartbeats, the
    loader opens a new connection on the same endpoint and asks to resume its session, naming the
    leases its loop still holds. A service that was only stalled still has the session: it keeps
    those leases (their slots stay untouched), returns the others, and carries on with the same pool.
    A restarted service does not know it: the loader gets a new session, checks that the feed is the
    same dataset with the same seed and geometry, and maps the new pool. Either way, if an epoch was
    under way, it is started again at the position the loop had reached. Batches received but not
    yet handed out are dropped (the new start covers them); batches the loop still holds stay valid
    (a resumed session keeps their leases; after a restart their old mapping lives as long as they
    do). In shard mode each image of the epoch is therefore still seen exactly once. If no service
    answers within ``timeout`` of the last word from the old one, ServiceTimeout.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from gpu_worker.connection import Connection, ServiceError, ServiceTimeout, SessionLost, make_hello
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
    FeedInfo,
    Release,
    Start,
    Welcome,
)

log = logging.getLogger(__name__)
Lease = tuple[int, int]
"""(session generation, lease id): leases of a lost session are never sent to its successor."""
__all__ = ["Batch", "LoaderConfig", "ServiceError", "ServiceLoader", "ServiceTimeout"]


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
        self._in_epoch = False
        self._released: deque[Lease] = deque()
        self._live: set[Lease] = set()
        self._run = 0
        self._passes = 0
        self._next_epoch = 0
        self._closed = False
        self._reconnected_at = 0.0
        self._stager: CudaStager | None = None
        self._slots: SlotMap | None = None
        cfg = self.config
        self._conn = Connection(
            cfg.endpoint,
            make_hello(
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
            ),
        )
        try:
            welcome = self._conn.open(
                time.monotonic() + cfg.connect_timeout,
                f"no loader service answered at {cfg.endpoint} within {cfg.connect_timeout:.0f} s "
                "(is `loader-service serve` running there?)",
            )
            self._adopt(welcome)
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
        elif self._in_epoch and self._current_epoch is not None and self._position < self._batches:
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
        held = self._held()
        if held:
            log.warning("closing with %d batches still referenced", held)
        if self._stager is not None:
            self._stager.close()
        if self._conn.session:
            self._conn.send(Bye())
        self._conn.close()
        if self._slots is not None:
            self._slots.close()

    # --- session --------------------------------------------------------------------------------

    def _adopt(self, welcome: Welcome) -> None:
        """Use a (new) session's feed: map its pool, pin it for CUDA."""
        old = self._slots
        self.info: FeedInfo = welcome.feed
        self._batches = welcome.batches
        try:
            layout = SlotLayout(self.info.batch_size, self.info.image_size)
            self._slots = SlotMap(self.info.segment, layout, self.info.slots)
        except (ValueError, OSError) as exc:
            # Never map memory a message merely names: only our own segments, whole, as announced.
            raise ServiceError(f"the service announced an unusable slot pool: {exc}") from None
        if self.device.type == "cuda":
            if self._stager is None:
                self._stager = CudaStager(self.device)
            self._stager.pin(self._slots.address, self._slots.nbytes)  # unregisters the old pool first
        if old is not None:
            old.close()  # unmaps once the batches still viewing it are gone

    def _reconnect(self, why: str) -> None:
        """NOTE [ Reconnecting ]."""
        log.warning("lost the loader service at %s (%s); reconnecting", self.config.endpoint, why)
        before = self.info
        gone_since = self._conn.last_heard
        released = set(self._released)
        held = tuple(lease for gen, lease in self._live - released if gen == self._conn.generation)
        welcome = self._conn.open(
            gone_since + self.config.timeout,
            f"the loader service at {self.config.endpoint} has been gone "
            f"for over {self.config.timeout:.0f} s",
            held[:MAX_RELEASES],
        )
        same = (welcome.feed.fingerprint, welcome.feed.seed, welcome.feed.batch_size, welcome.feed.image_size)
        if same != (before.fingerprint, before.seed, before.batch_size, before.image_size):
            raise ServiceError(
                f"the service at {self.config.endpoint} came back serving "
                "a different dataset, seed or geometry"
            )
        if self._conn.resumed:  # the service returned every lease not in ``held``: forget them
            current = self._conn.generation
            self._live = {lease for lease in self._live if lease[0] != current or lease[1] in held}
            self._released = deque(lease for lease in self._released if lease[0] != current)
        else:
            self._adopt(welcome)
        self._reconnected_at = time.monotonic()
        log.warning(
            "%s session %s", "resumed" if self._conn.resumed else "reconnected as", self._conn.session
        )
        if self._in_epoch and self._current_epoch is not None:
            self._run += 1
            self._conn.send(Start(self._run, self._current_epoch, self._position))

    def _recv(self, deadline: float) -> Any:
        """The next message within ``deadline``, reconnecting on the way if the session was lost."""
        while True:
            if self._stager is not None:
                self._stager.collect()
            self._flush_releases()
            try:
                return self._conn.recv(deadline)
            except SessionLost as lost:
                self._reconnect(str(lost))

    # --- delivery -------------------------------------------------------------------------------

    def _epoch(self, epoch: int, position: int) -> Iterator[Batch]:
        self._run += 1
        self._passes += 1
        mine = self._passes  # runs also change on reconnects and restarts; passes only here
        self._current_epoch, self._position, self._in_epoch = epoch, position, True
        self._conn.send(Start(self._run, epoch, position))
        try:
            while True:
                msg = self._next_batch()
                if isinstance(msg, EpochEnd):
                    self._position = self._batches
                    self._flush_releases()  # credits back now, so the next epoch can be decoded ahead
                    return
                batch = self._wrap(msg)
                self._position = msg.seq + 1
                if batch is not None:
                    yield batch
                del batch  # the generator must not keep the previous batch's slot while waiting
        finally:
            if self._passes == mine:  # an abandoned older pass must not end the current one
                self._in_epoch = False

    def _next_batch(self) -> BatchReady | EpochEnd:
        """Wait for the current run's next batch or its end; batches of older runs are released unread."""
        self._check_not_starved()
        started = time.monotonic()
        deadline = started + self.config.timeout
        while True:
            msg = self._recv(deadline)
            if msg is None:
                if self._reconnected_at > started:  # the clock restarts with the new session
                    started = self._reconnected_at
                    deadline = started + self.config.timeout
                    continue
                raise self._timeout_error()
            shard = self.config.mode == "shard"  # a broadcast member may join where its group is
            if shard and isinstance(msg, BatchReady) and msg.run == self._run and msg.seq != self._position:
                self._released.append((self._conn.generation, msg.lease))
                self._restart_at_position(msg.seq)
                continue
            if isinstance(msg, (BatchReady, EpochEnd)) and msg.run == self._run:
                return msg
            if isinstance(msg, BatchReady):
                self._released.append((self._conn.generation, msg.lease))

    def _restart_at_position(self, arrived: int) -> None:
        """A batch went missing on the way: ask for the epoch again from the one that is due."""
        log.warning("batch %d arrived where %d was due; restarting the epoch there", arrived, self._position)
        assert self._current_epoch is not None
        self._run += 1
        self._conn.send(Start(self._run, self._current_epoch, self._position))

    def _held(self) -> int:
        return len(self._live - set(self._released))

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
        silent = time.monotonic() - self._conn.last_heard
        held = self._held()
        if silent > self.config.timeout / 2:
            why = f"the service at {self.config.endpoint} has been silent for {silent:.0f} s"
        else:
            why = f"the service is alive but sent nothing; this trainer holds {held} of {self.config.credits}"
        return ServiceTimeout(f"no batch within {self.config.timeout:.0f} s: {why}")

    def _wrap(self, msg: BatchReady) -> Batch | None:
        assert self._slots is not None
        lease = (self._conn.generation, msg.lease)
        if msg.count == 0 or msg.count > self.info.batch_size:
            self._released.append(lease)  # every file of the batch was bad
            return None
        layout = self._slots.layout
        try:
            owner = self._slots.slot(msg.slot)
        except ValueError as exc:
            raise ServiceError(f"service announced an invalid slot: {exc}") from None
        self._live.add(lease)
        # NOTE [ Slot lifecycle ]: the lease ends when ``owner`` dies, i.e. with the last view of it.
        fin = weakref.finalize(owner, self._released.append, lease)
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
        current = self._conn.generation
        while self._released:
            leases: list[int] = []
            while self._released and len(leases) < MAX_RELEASES:
                generation, lease = self._released.popleft()
                self._live.discard((generation, lease))
                if generation == current:  # a lost session's leases died with it
                    leases.append(lease)
            if leases:
                self._conn.send(Release(tuple(leases)))
