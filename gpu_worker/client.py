"""``ServiceLoader``: the trainer's loop over a service feed, a drop-in for a DataLoader loop.

    with ServiceLoader("ipc:///run/dataferry/train.sock", device="auto") as loader:
        for epoch in range(10):
            for images, labels in loader:   # a Batch unpacks as its fields, in the feed's order
                ...

The session itself (sockets, heartbeats, loss detection) is ``gpu_worker.connection``; the leases
the loop holds and their releases are ``gpu_worker.leases``; what the loop receives is
``gpu_worker.batch``. Only the iterating thread touches the socket: it sends releases and starts, and
again whatever the socket refused, at every wait (NOTE [ Releases that could not be sent ]).

NOTE [ Reconnecting ]
    When the service restarts (it answers ``no-session``) or goes silent for several heartbeats, the
    loader opens a new connection on the same endpoint and asks to resume its session, naming the
    leases its loop still holds or has not taken yet and how far it has received every announcement.
    A service that was only stalled still has the session: it keeps those leases (their slots stay
    untouched), returns the others, announces again everything after what was received (NOTE
    [ Acknowledged delivery ] in ``gpu_worker/arrivals.py``) and carries on with the same pool and
    the same run: nothing is lost or doubled, in shard and broadcast mode alike.
    A restarted service (or one that had already given the session up) does not know it: the loader
    gets a new session, checks that the feed is the same dataset with the same seed, geometry and
    fields, and maps the new pool; if an epoch was under way, it is started again at the position
    the loop had reached, and batches received but not yet handed out are dropped (the new start
    covers them). Batches the loop still holds stay valid (a resumed session keeps their leases;
    after a restart their old mapping lives as long as they do). In shard mode each image of the
    epoch is therefore still seen exactly once. If no service answers within ``timeout`` of the last
    word from the old one, ServiceTimeout.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

from gpu_worker.batch import Batch
from gpu_worker.connection import Connection, ServiceError, ServiceTimeout, SessionLost, make_hello
from gpu_worker.curve import ClientKeys, warn_if_in_the_clear
from gpu_worker.delivery import Delivery
from gpu_worker.device import resolve_device
from gpu_worker.fields import (
    ExpectedFields,
    as_expected,
    expected_fields,
    field_differences,
)
from gpu_worker.leases import LeaseBook
from gpu_worker.loader_config import GROUP_SECRET_ENV, LoaderConfig, shard_of
from protocol.layout import SlotLayout, describe_fields
from protocol.messages import MAX_RELEASES, BatchReady, Bye, EpochEnd, FeedInfo, Start, Welcome

log = logging.getLogger(__name__)
__all__ = ["Batch", "LoaderConfig", "ServiceError", "ServiceLoader", "ServiceTimeout"]
RESEND_SLICE = 0.1
"""While the loop waits for the service, how often it offers what could not be sent yet (kept
releases and start, NOTE [ Releases that could not be sent ]) and collects finished device copies."""


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
        transport: str = "auto",
        server_key: str | None = None,
        client_key: str | None = None,
        fields: ExpectedFields | None = None,
        group_secret: str | None = None,
    ) -> None:
        """``fields``: what the trainer expects each batch to hold, e.g. ``{"image": ((3, 224, 224),
        torch.uint8), "label": ((), torch.int64)}``; a feed that serves anything else (missing, extra,
        shape, dtype or order) raises ServiceError naming every difference before any batch.
        ``group_secret`` (default: ``DATAFERRY_GROUP_SECRET``): a broadcast group is its name among the
        trainers that share this secret, so others on the service can neither join it nor hold it up."""
        rank, world_size = shard_of(mode, rank, world_size)
        self.config = LoaderConfig(
            endpoint,
            device,
            feed,
            credits,
            timeout,
            connect_timeout,
            mode,
            rank,
            world_size,
            remainder,
            group,
            group_size,
            batch_size or 0,
            image_size or 0,
            transport,
            fields=() if fields is None else expected_fields(fields),
            group_secret=os.environ.get(GROUP_SECRET_ENV, "") if group_secret is None else group_secret,
        ).validated()
        keys = ClientKeys.load(server_key, client_key)
        warn_if_in_the_clear(endpoint, keys)
        self.device = resolve_device(device)
        self._resume: tuple[int, int] | None = None
        self._position = 0
        self._current_epoch: int | None = None
        self._in_epoch = False
        self._leases = LeaseBook()
        self._unsent_start: Start | None = None
        self._last_start: tuple[Start, float] | None = None
        """The current run's start and when it went out: sent again if the service never shows it."""
        self._run = 0
        self._passes = 0
        self._next_epoch = 0
        self._closed = False
        self._reconnected_at = 0.0
        self._delivery = Delivery(self.device, transport, self._leases)
        cfg = self.config
        self._conn = Connection(cfg.endpoint, make_hello(**cfg.hello_fields()), keys)
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

    @property
    def layout(self) -> SlotLayout:
        """The feed's batch layout: its fields (``protocol.layout.FieldSpec``) and their place in a slot."""
        return self._delivery.layout

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What each batch holds, in order: name -> (shape of one sample, dtype), as ``fields=`` takes."""
        return as_expected(self._delivery.layout.fields)

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
        if self._conn.session:
            self._conn.send(Bye())
        self._conn.close()
        self._delivery.close()

    # --- session --------------------------------------------------------------------------------

    def _adopt(self, welcome: Welcome) -> None:
        """Use a (new) session's feed and pool."""
        self.info: FeedInfo = welcome.feed
        self._batches = welcome.batches
        self._credits = min(self.config.credits, welcome.credits)
        self._delivery.adopt(self.info)
        self._conn.batch_bytes = self._delivery.batch_bytes
        self._check_fields()

    def _check_fields(self) -> None:
        """Refuse a feed whose fields are not the ones this trainer stated (``fields=``); no start
        has been sent yet, so no batch has been taken."""
        served = self._delivery.layout.fields
        differences = field_differences(self.config.fields, served) if self.config.fields else []
        if differences:
            raise ServiceError(
                f"feed {self.info.name!r} does not serve the fields this trainer expects: "
                f"{'; '.join(differences)} (it serves {describe_fields(served)})"
            )

    def _reconnect(self, why: str) -> None:
        """NOTE [ Reconnecting ]."""
        log.warning("lost the loader service at %s (%s); reconnecting", self.config.endpoint, why)
        before = self.info
        gone_since = self._conn.last_heard
        generation = self._conn.generation
        held = (*self._leases.held_ids(generation), *self._conn.waiting_leases())[:MAX_RELEASES]
        welcome = self._conn.open(
            gone_since + self.config.timeout,
            f"the loader service at {self.config.endpoint} has been gone "
            f"for over {self.config.timeout:.0f} s",
            held,
        )
        after = welcome.feed
        same = (after.fingerprint, after.seed, after.batch_size, after.image_size, after.fields)
        if same != (before.fingerprint, before.seed, before.batch_size, before.image_size, before.fields):
            raise ServiceError(
                f"the service at {self.config.endpoint} came back serving "
                "a different dataset, seed, geometry or fields"
            )
        self._reconnected_at = time.monotonic()
        log.warning(
            "%s session %s", "resumed" if self._conn.resumed else "reconnected as", self._conn.session
        )
        if self._conn.resumed:  # the service returned every lease not in ``held``: forget them
            self._leases.resumed(self._conn.generation, held)
            return  # the same run goes on: what was lost is announced again
        self._unsent_start = self._last_start = None  # meaningless to a new session
        self._adopt(welcome)
        if self._in_epoch and self._current_epoch is not None:
            self._run += 1
            self._send_start(self._start(self._current_epoch, self._position))

    def _recv(self, deadline: float) -> Any:
        """The next message within ``deadline``, reconnecting on the way if the session was lost.

        The wait is cut into short slices, each of which first sends what is pending: releases that
        other threads let go meanwhile, and whatever the socket refused before.
        """
        while True:
            self._send_pending()
            try:
                msg = self._conn.recv(min(deadline, time.monotonic() + RESEND_SLICE))
            except SessionLost as lost:
                self._reconnect(str(lost))
                continue
            if msg is not None or time.monotonic() >= deadline:
                return msg

    def _send_pending(self) -> None:
        """NOTE [ Releases that could not be sent ]: the kept start first, then every release."""
        self._delivery.collect()  # device copies that have finished let their slots go
        self._start_again_if_lost()
        if self._unsent_start is not None:
            self._send_start(self._unsent_start)
        self._leases.flush(self._conn.generation, self._conn.send)
        if self._conn.session and self._conn.arrivals.ack_due:
            self._ack()

    def _ack(self) -> None:
        """NOTE [ Acknowledged delivery ]: after the releases, on the same socket."""
        have = self._conn.arrivals.have
        unreleased = (*self._leases.unreleased_ids(self._conn.generation), *self._conn.waiting_leases())
        self._conn.ack(tuple(lease for lease in unreleased if lease <= have))

    def _start_again_if_lost(self) -> None:
        """A start the service's heartbeats still do not show a heartbeat interval after it went out
        was lost with a connection (NOTE [ Acknowledged delivery ]); the service ignores a repeat."""
        if self._last_start is None or self._unsent_start is not None:
            return
        start, sent_at = self._last_start
        conn = self._conn
        if conn.service_run != start.run and conn.heard_run_at - sent_at > conn.heartbeat_interval:
            log.info("the service does not show run %d started; sending its start again", start.run)
            self._send_start(start)

    def _start(self, epoch: int, position: int) -> Start:
        return Start(self._run, epoch, position, transport=self.transport)

    @property
    def transport(self) -> str:
        """How batches arrive: ``shm`` (the slot mapped in place) or ``tcp`` (bytes over the socket)."""
        return self._delivery.transport

    def _send_start(self, start: Start) -> None:
        """Send ``start``, or keep it to send again (it supersedes any start kept before)."""
        if self._conn.send(start):
            self._unsent_start, self._last_start = None, (start, time.monotonic())
        else:
            self._unsent_start = start

    # --- delivery -------------------------------------------------------------------------------

    def _epoch(self, epoch: int, position: int) -> Iterator[Batch]:
        self._run += 1
        self._passes += 1
        mine = self._passes  # runs also change on reconnects and restarts; passes only here
        self._current_epoch, self._position, self._in_epoch = epoch, position, True
        self._unsent_start = None  # a start kept from an earlier pass is superseded by this one
        self._send_pending()  # what the last pass let go is returned before this pass is asked for
        self._send_start(self._start(epoch, position))
        try:
            while self._position < self._batches:  # the last batch ends the pass: its end may be lost
                msg = self._next_batch()
                if isinstance(msg, EpochEnd):
                    self._position = self._batches
                    break
                batch = self._wrap(msg)
                self._position = msg.seq + 1
                if batch is not None:
                    yield batch
                del batch  # the generator must not keep the previous batch's slot while waiting
            self._send_pending()  # credits back now, so the next epoch can be decoded ahead
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
                self._unread(msg)
                self._restart_at_position(msg.seq)
                continue
            if isinstance(msg, (BatchReady, EpochEnd)) and msg.run == self._run:
                return msg
            if isinstance(msg, BatchReady):
                self._unread(msg)

    def _restart_at_position(self, arrived: int) -> None:
        """A batch went missing on the way: ask for the epoch again from the one that is due."""
        log.warning("batch %d arrived where %d was due; restarting the epoch there", arrived, self._position)
        assert self._current_epoch is not None
        self._run += 1
        self._send_start(self._start(self._current_epoch, self._position))

    def _held(self) -> int:
        return self._leases.held()

    def _check_not_starved(self) -> None:
        """Fail at once, not after the timeout, when held batches use up every credit (CPU zero-copy)."""
        if self._delivery.stager is not None or self._held() < self._credits:
            return
        gc.collect()  # batches in unreachable cycles still pin their slots until collected
        if self._held() >= self._credits:
            raise ServiceError(
                f"this trainer still references all {self._credits} batches its credits allow, so the "
                "service cannot send another: drop references to old batches (keep .clone() copies if "
                "needed), or pass a larger credits= to ServiceLoader"
            )

    def _timeout_error(self) -> ServiceTimeout:
        silent = time.monotonic() - self._conn.last_heard
        held = self._held()
        if silent > self.config.timeout / 2:
            why = f"the service at {self.config.endpoint} has been silent for {silent:.0f} s"
        else:
            why = f"the service is alive but sent nothing; this trainer holds {held} of {self._credits}"
        return ServiceTimeout(f"no batch within {self.config.timeout:.0f} s: {why}")

    def _unread(self, msg: BatchReady) -> None:
        """Give back a batch the loop will not see (an older run's, or out of order)."""
        self._conn.payloads.pop(msg.lease, None)
        self._leases.let_go((self._conn.generation, msg.lease))

    def _wrap(self, msg: BatchReady) -> Batch | None:
        lease = (self._conn.generation, msg.lease)
        frames = self._conn.payloads.pop(msg.lease, None)
        if msg.count == 0 or msg.count > self.info.batch_size:
            self._leases.let_go(lease)  # every file of the batch was bad
            return None
        return self._delivery.wrap(msg, lease, frames)
