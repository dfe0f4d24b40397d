"""The decoded-sample cache in a real service (NOTE [ Sample cache ]): the same batches as a service
without one, epoch after epoch and trainer after trainer; a decode worker killed while the cache
fills; the segment removed at shutdown and after a SIGKILL; a /dev/shm too small, a size too small
for the table and a pipeline wrongly declared deterministic, each refused at start."""

from __future__ import annotations

import grp
import os
import signal
import stat
from pathlib import Path

import pytest
import torch

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from tests.helpers import (
    ServiceFactory,
    ServiceProcess,
    our_segments,
    private_shm_available,
    status,
)

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pipelines"
Epoch = dict[int, torch.Tensor]


def epochs(endpoint: str, count: int, first: int = 0) -> list[Epoch]:
    """Every sample's image, by index, of epochs ``first`` to ``first + count - 1``."""
    out: list[Epoch] = []
    with ServiceLoader(endpoint, timeout=30) as loader:
        for epoch in range(first, first + count):
            loader.set_epoch(epoch)
            seen: Epoch = {}
            for batch in loader:
                for row, idx in enumerate(batch.indices.tolist()):
                    assert idx not in seen, f"sample {idx} twice in epoch {epoch}"
                    seen[idx] = batch["image"][row].clone()
            out.append(seen)
    return out


def same(a: Epoch, b: Epoch) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)


def cache_status(endpoint: str) -> dict[str, object]:
    found = status(endpoint)["feeds"][0]["cache"]
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize(("augment", "plain_decoder"), [("train", "opencv"), ("eval", "auto")])
def test_every_epoch_and_trainer_gets_the_batches_of_a_service_without_a_cache(
    photos: Path, start_service: ServiceFactory, augment: str, plain_decoder: str
) -> None:
    n = len(build_index(photos))
    cached = start_service(photos, name="cached", augment=augment, cache_memory="256M")
    plain = start_service(photos, name="plain", augment=augment, decoder=plain_decoder)
    got, expected = epochs(cached.endpoint, 3), epochs(plain.endpoint, 3)
    for epoch in range(3):
        assert len(got[epoch]) == n and same(got[epoch], expected[epoch]), f"epoch {epoch}"
    after = cache_status(cached.endpoint)
    assert after["entries"] == n and not after["full"]
    assert isinstance(after["hits"], int) and after["hits"] >= n  # the later epochs came from it
    # Another trainer, another run: its epoch is made from what the first one's decoded.
    again = epochs(cached.endpoint, 1, first=2)[0]
    assert same(again, expected[2])
    assert cache_status(cached.endpoint)["hits"] >= after["hits"] + n  # type: ignore[operator]


def test_a_worker_killed_while_the_cache_fills_costs_no_sample(
    photos: Path, start_service: ServiceFactory
) -> None:
    n = len(build_index(photos))
    cached = start_service(photos, name="cached", batch_size=4, cache_memory="256M")
    plain = start_service(photos, name="plain", batch_size=4, decoder="opencv")
    killed = False
    got: list[Epoch] = []
    with ServiceLoader(cached.endpoint, timeout=30) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen: Epoch = {}
            for batch in loader:
                for row, idx in enumerate(batch.indices.tolist()):
                    seen[idx] = batch["image"][row].clone()
                busy = [w for w in status(cached.endpoint)["worker_list"] if w["task"] is not None]
                if not killed and busy:
                    os.kill(int(busy[0]["pid"]), signal.SIGKILL)
                    killed = True
            got.append(seen)
    assert killed
    cached.wait_for(r"decode worker \d \(pid \d+\) died with exit code -9")
    expected = epochs(plain.endpoint, 2)
    for epoch in range(2):
        assert len(got[epoch]) == n and same(got[epoch], expected[epoch]), f"epoch {epoch}"
    # At most the sample the worker was writing is left out of the cache, never a torn one served.
    assert cache_status(cached.endpoint)["entries"] in (n - 1, n)  # type: ignore[operator]


def test_the_cache_segment_goes_at_shutdown_and_after_a_sigkill(
    photos: Path, start_service: ServiceFactory
) -> None:
    first = start_service(photos, name="svc", cache_memory="64M")
    segment = first.wait_for(r"sample cache of 64.0 MiB keeps [\w ]+ \((dataferry-[^)]+)\)").group(1)
    assert segment in our_segments()
    assert (Path("/dev/shm") / segment).stat().st_size == 64 * 2**20  # all of it reserved at start
    first.kill_group()
    assert segment in our_segments(), "a killed service cannot clean up"
    second = start_service(photos, name="svc", cache_memory="64M")
    # This start removes it, unless another service sharing /dev/shm started first and did.
    assert segment not in our_segments()
    own = second.wait_for(r"sample cache of 64.0 MiB keeps [\w ]+ \((dataferry-[^)]+)\)").group(1)
    assert second.stop() == 0
    assert own not in our_segments()


def test_with_a_group_the_slots_are_the_groups_and_the_cache_the_services_alone(
    photos: Path, start_service: ServiceFactory
) -> None:
    """``--group`` opens the slot pool to the trainers' group; the cache, which no trainer maps and
    whose entries every later epoch serves, stays 0600 (one write there would change a sample for
    good)."""
    group = grp.getgrgid(os.getgid()).gr_name
    service = start_service(photos, cache_memory="16M", group=group)
    cache = service.wait_for(r"sample cache of 16.0 MiB keeps [\w ]+ \((dataferry-[^)]+)\)").group(1)
    (pool,) = {n for n in our_segments() if n.startswith(f"dataferry-{service.proc.pid}-train-")} - {cache}
    assert stat.S_IMODE((Path("/dev/shm") / pool).stat().st_mode) == 0o660
    assert stat.S_IMODE((Path("/dev/shm") / cache).stat().st_mode) == 0o600


@pytest.mark.skipif(not private_shm_available(), reason="needs a private /dev/shm (unshare --mount)")
def test_a_dev_shm_too_small_for_the_cache_fails_at_start_with_the_size_needed(
    photos: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/small.sock"
    args = ["serve", "--data", str(photos), "--endpoint", endpoint, "--image-size", "32"]
    service = ServiceProcess([*args, "--cache-memory", "64M"], endpoint, private_shm=True)
    try:
        assert service.proc.wait(60) == 2
        service.wait_for(r"/dev/shm has \d+ MiB free but the decoded-sample cache needs 64 MiB")
        assert "Lower --cache-memory" in service.log
    finally:
        service.kill_group()


def test_a_cache_too_small_for_its_table_exits_2(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, wait_ready=False, cache_memory="1K")
    assert service.proc.wait(60) == 2
    service.wait_for(r"cache_memory of 1024 bytes is below the \d+ its table for 90 samples takes")
    left = [name for name in our_segments() if name.startswith(f"dataferry-{service.proc.pid}-")]
    assert not left, "the slot pool made before it is removed too"


def test_a_random_pipeline_declared_deterministic_is_refused(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(
        photos,
        wait_ready=False,
        pipeline=f"{EXAMPLES / 'numpy_aug.py'}:train",
        pipeline_deterministic=True,
        cache_memory="64M",
    )
    assert service.proc.wait(120) == 2
    service.wait_for(r"is declared deterministic .* differs between epochs 0 and 1")


def test_a_deterministic_pipeline_is_served_from_its_cache(
    photos: Path, start_service: ServiceFactory
) -> None:
    n = len(build_index(photos))
    spec = f"{EXAMPLES / 'numpy_aug.py'}:evaluate"
    cached = start_service(photos, name="c", pipeline=spec, pipeline_deterministic=True, cache_memory="128M")
    plain = start_service(photos, name="p", pipeline=spec)
    got, expected = epochs(cached.endpoint, 2), epochs(plain.endpoint, 2)
    assert all(same(g, e) for g, e in zip(got, expected, strict=True))
    found = cache_status(cached.endpoint)
    assert found["kind"] == "final" and found["entries"] == n
