"""Soak: a hundred trainers attach and detach at random, some killed; the service stays whole."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from loader_service.supervisor.warm import WARM_BATCHES
from tests.helpers import DIE_AFTER, ServiceFactory, in_threads, our_segments, status, trainer_process

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


def test_hundred_trainers_come_and_go(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, batch_size=4, slots=12, client_timeout=2, image_size=32)
    rng = random.Random(1)
    plans = [
        (rng.choice(["shard", "broadcast-solo"]), rng.randint(0, 12), rng.random() < 0.3)
        for _ in range(TRAINERS)
    ]
    gate = threading.Semaphore(CONCURRENT)

    def trainer(mode: str, take: int, rank_two: bool) -> int:
        kwargs: dict[str, object] = {"timeout": 30}
        if mode == "broadcast-solo":
            kwargs.update(mode="broadcast", group=f"g{take}", group_size=1)
        elif rank_two:
            kwargs.update(rank=1, world_size=2)
        with gate, ServiceLoader(service.endpoint, **kwargs) as loader:  # type: ignore[arg-type]
            got = 0
            for batch in loader:
                got += 1
                if got >= take:
                    break
                del batch
            return got

    trainer("shard", 30, False)  # warm up: workers imported, pool touched, caches filled
    warm = rss_kib(service.proc.pid)
    killed: list[subprocess.Popen[str]] = []
    try:
        for i in range(KILLED):
            killed.append(trainer_process(service.endpoint, DIE_AFTER, str(1 + i % 3), "shard"))
        results = in_threads([lambda p=p: trainer(*p) for p in plans], timeout=240)
        for proc in killed:
            proc.wait(90)  # each kills itself after a few batches
    finally:
        for proc in killed:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)
    assert all(proc.returncode == -signal.SIGKILL for proc in killed)
    assert all(r >= 0 for r in results)
    service.wait_for(r"detached: no heartbeat for 2 s", timeout=30, count=KILLED)
    body = status(service.endpoint)
    assert body["attached"] == 0
    slots = body["feeds"][0]["slots"]
    assert slots["leased"] == 0 and sum(slots.values()) == 12, "the pool is whole"
    assert slots["ready"] + slots["filling"] <= WARM_BATCHES, "only the warm cache holds slots"
    assert body["worker_restarts"] == 0
    growth = rss_kib(service.proc.pid) - warm
    print(f"soak: service + workers RSS {warm} KiB after warm-up, grew by {growth} KiB")
    assert growth < 64 * 1024, f"service and workers grew by {growth / 1024:.0f} MiB"
    mine = {n for n in our_segments() if n.startswith(f"dataferry-{service.proc.pid}-")}
    assert len(mine) == 1, f"only the pool in /dev/shm: {mine}"
    assert service.stop() == 0
