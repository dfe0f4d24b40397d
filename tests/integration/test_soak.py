"""Soak: a hundred trainers attach and detach at random, some killed; the service stays whole."""

from __future__ import annotations

import functools
import hashlib
import random
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from gpu_worker import Batch, ServiceLoader
from gpu_worker.client import LoaderConfig
from loader_service.dataset.index import build_index
from loader_service.dataset.sampler import shard_order
from loader_service.supervisor.streams.early import WARM_BATCHES
from protocol.messages import FeedInfo
from protocol.shares import batches_per_epoch, shard_size
from tests.helpers import (
    DIE_AFTER,
    ServiceFactory,
    ServiceProcess,
    in_threads,
    our_segments,
    status,
    trainer_process,
    wait_until,
)

pytestmark = pytest.mark.integration
TRAINERS = 100
KILLED = 8
CONCURRENT = 12


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children (the decode workers)."""
    total = 0
    for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


@dataclass(frozen=True)
class Delivered:
    """One batch as a trainer saw it: its place in the epoch plan, and a sha1 of each image's pixels."""

    epoch: int
    seq: int
    indices: list[int]
    labels: list[int]
    pixels: list[str]

    @classmethod
    def of(cls, batch: Batch) -> Delivered:
        images = batch.images.numpy()
        pixels = [hashlib.sha1(image.tobytes()).hexdigest() for image in images]
        return cls(batch.epoch, batch.seq, batch.indices.tolist(), batch.labels.tolist(), pixels)


@dataclass(frozen=True)
class Received:
    """Everything one trainer got, with the shard and feed that say which batches were due."""

    config: LoaderConfig
    info: FeedInfo
    batches: list[Delivered]

    @property
    def per_epoch(self) -> int:
        """Batches in this trainer's epoch, from the sampler rather than from what the service said."""
        shard = shard_size(self.info.samples, self.config.world_size, self.config.remainder)
        return batches_per_epoch(shard, self.info.batch_size)


def due_seqs(got: Received, take: int, ended: set[str]) -> list[int]:
    """The batches a trainer that stops after ``take`` must have got, in order.

    A shard trainer starts at batch 0. A broadcast member whose group is already in its epoch starts
    at the oldest batch the group still holds, and gets none if the group has sent its last batch
    (NOTE [ Broadcast epochs ]); ``ended`` names the groups some trainer saw to their last batch. The
    loop hands over one batch before it can stop, so ``take=0`` still gets one; the epoch's end stops
    it early.
    """
    first = 0
    if got.config.mode == "broadcast":
        if not got.batches and got.config.group in ended:
            return []
        first = got.batches[0].seq if got.batches else 0
    return list(range(first, min(first + max(take, 1), got.per_epoch)))


def ended_groups(results: list[Received]) -> set[str]:
    """Broadcast groups that some trainer followed to the last batch of the epoch."""
    return {
        got.config.group
        for got in results
        if got.config.mode == "broadcast" and got.batches and got.batches[-1].seq == got.per_epoch - 1
    }


def problems(
    got: Received, take: int, ended: set[str], labels: npt.NDArray[np.int64], pixels: dict[int, str]
) -> list[str]:
    """How ``got`` differs from its due batches of epoch 0: their samples, labels and decoded pixels."""
    cfg, info = got.config, got.info
    found = []
    due_seq = due_seqs(got, take, ended)
    if [b.seq for b in got.batches] != due_seq:
        found.append(f"got batches {[b.seq for b in got.batches]}, due {due_seq}")
    order = shard_order(info.seed, 0, info.samples, cfg.rank, cfg.world_size, cfg.remainder)
    for b in got.batches:
        due = order.batch(b.seq, info.batch_size).tolist() if b.seq < got.per_epoch else None
        if b.epoch != 0 or b.indices != due:
            found.append(f"batch {b.seq} of epoch {b.epoch} held samples {b.indices}, due {due}")
        elif b.labels != labels[b.indices].tolist() or b.pixels != [pixels[i] for i in b.indices]:
            found.append(f"batch {b.seq} held the right samples with wrong labels or pixels")
    return found


def all_sessions_end(service: ServiceProcess) -> None:
    """Every session ends: a killed trainer's when its heartbeats stop, the others' at their bye.

    Awaited on the service's own account, not by counting "no heartbeat" lines: a trainer's close
    sends its bye without waiting for it (gpu_worker/service.py), so the last trainers' byes can
    still be on their way when the loop returns, and on a loaded host a live trainer's late
    heartbeat ends its session too (it reconnects and goes on). The count of those lines was once
    reached with two sessions still attached (issue 45)."""
    wait_until(lambda: status(service.endpoint)["attached"] == 0, "every session ended", timeout=30)
    expired = [line for line in service.lines if "detached: no heartbeat for 2 s" in line]
    print(f"soak: {len(expired)} sessions ended by their heartbeat timeout ({KILLED} trainers killed)")
    assert len(expired) >= KILLED, "each killed trainer's session ended by its timeout"


def test_hundred_trainers_come_and_go(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, batch_size=4, slots=12, client_timeout=2, image_size=32)
    rng = random.Random(1)
    plans = [
        (rng.choice(["shard", "broadcast-solo"]), rng.randint(0, 12), rng.random() < 0.3)
        for _ in range(TRAINERS)
    ]
    gate = threading.Semaphore(CONCURRENT)

    def trainer(mode: str, take: int, rank_two: bool) -> Received:
        kwargs: dict[str, object] = {"timeout": 30}
        if mode == "broadcast-solo":
            kwargs.update(mode="broadcast", group=f"g{take}", group_size=1)
        elif rank_two:
            kwargs.update(rank=1, world_size=2)
        with gate, ServiceLoader(service.endpoint, **kwargs) as loader:  # type: ignore[arg-type]
            got = Received(loader.config, loader.info, [])
            for batch in loader:
                got.batches.append(Delivered.of(batch))
                if len(got.batches) >= take:
                    break
                del batch
            return got

    # Warm up (workers imported, pool touched, caches filled) with a whole epoch: its pixels are the
    # reference, since a sample decodes to the same pixels in an epoch whoever receives it.
    reference = trainer("shard", 30, False)
    labels = build_index(photos).labels
    pixels = {i: sha for b in reference.batches for i, sha in zip(b.indices, b.pixels, strict=True)}
    assert sorted(pixels) == list(range(len(labels))) and reference.info.samples == len(labels)
    assert problems(reference, 30, set(), labels, pixels) == []
    warm = rss_kib(service.proc.pid)
    killed: list[subprocess.Popen[str]] = []
    try:
        for i in range(KILLED):
            killed.append(trainer_process(service.endpoint, DIE_AFTER, str(1 + i % 3), "shard"))
        results = in_threads([functools.partial(trainer, *p) for p in plans], timeout=240)
        for proc in killed:
            proc.wait(90)  # each kills itself after a few batches
    finally:
        for proc in killed:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)
    assert all(proc.returncode == -signal.SIGKILL for proc in killed)
    # Every trainer got exactly its due batches, each holding the planned samples, labels and pixels:
    # a slot reused too early, a lost or repeated batch, or a session cut short fails here.
    ended = ended_groups(results)
    wrong = {
        i: found
        for i, (p, got) in enumerate(zip(plans, results, strict=True))
        if (found := problems(got, p[1], ended, labels, pixels))
    }
    assert not wrong, {i: (plans[i], found[:3]) for i, found in list(wrong.items())[:5]}
    all_sessions_end(service)
    body = status(service.endpoint)
    slots = body["feeds"][0]["slots"]
    assert slots["leased"] == 0 and sum(slots.values()) == 12, "the pool is whole"
    assert slots["ready"] + slots["filling"] <= WARM_BATCHES, "only the warm start holds slots"
    assert body["worker_restarts"] == 0
    growth = rss_kib(service.proc.pid) - warm
    print(f"soak: service + workers RSS {warm} KiB after warm-up, grew by {growth} KiB")
    assert growth < 64 * 1024, f"service and workers grew by {growth / 1024:.0f} MiB"
    mine = {n for n in our_segments() if n.startswith(f"dataferry-{service.proc.pid}-")}
    assert len(mine) == 1, f"only the pool in /dev/shm: {mine}"
    assert service.stop() == 0
