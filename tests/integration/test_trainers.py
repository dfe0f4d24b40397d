"""Several trainers on one feed: DDP shards, broadcast groups, resume after a kill, several feeds."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import ServiceError, ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.dataset.sampler import epoch_permutation
from tests.helpers import (
    DIE_AFTER,
    ServiceFactory,
    ServiceProcess,
    SourceData,
    epoch_indices,
    in_threads,
    job_steps,
    status,
    trainer_process,
)

pytestmark = pytest.mark.integration


# --- shard -------------------------------------------------------------------------------------


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_four_ranks_cover_an_epoch_once_with_equal_batch_counts(
    photos: Path, start_service: ServiceFactory, remainder: str
) -> None:
    n = len(build_index(photos))  # 90: not a multiple of 4
    service = start_service(photos, batch_size=8)

    def rank(r: int) -> tuple[list[int], int, int]:
        with ServiceLoader(service.endpoint, rank=r, world_size=4, remainder=remainder, timeout=30) as loader:
            seen, batches = epoch_indices(loader)
            return seen, batches, len(loader)

    results = in_threads([lambda r=r: rank(r) for r in range(4)])
    counts = {batches for _, batches, _ in results} | {length for _, _, length in results}
    assert len(counts) == 1, f"every rank must run as many steps: {counts}"
    assert {len(seen) for seen, _, _ in results} == {-(-n // 4) if remainder == "pad" else n // 4}
    together = Counter(i for seen, _, _ in results for i in seen)
    if remainder == "drop":
        assert len(together) == n - n % 4 and set(together.values()) == {1}
    else:
        assert set(together) == set(range(n)), "pad covers every image"
        assert sum(together.values()) - n == 4 - n % 4, "only the padding repeats"


def test_rank_and_world_size_default_to_torchrun_environment(
    photos: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = start_service(photos)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        assert (loader.config.rank, loader.config.world_size) == (1, 3)
        assert len(loader) == -(-30 // 8)


def test_shards_agree_across_services_without_coordination(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Two hosts = two services with the same data and seed; each serves one rank."""
    hosts = [start_service(photos, seed=3, name=f"host{h}") for h in range(2)]
    seen = []
    for r, host in enumerate(hosts):
        with ServiceLoader(host.endpoint, rank=r, world_size=2, timeout=30) as loader:
            loader.set_epoch(4)
            seen.append(epoch_indices(loader)[0])
    assert sorted(seen[0] + seen[1]) == list(range(len(build_index(photos))))
    assert not set(seen[0]) & set(seen[1])


# --- broadcast ---------------------------------------------------------------------------------


def test_broadcast_group_decodes_once_and_every_member_sees_every_image(
    photos: Path, start_service: ServiceFactory
) -> None:
    n = len(build_index(photos))
    service = start_service(photos, batch_size=8, slots=8)

    def member() -> list[list[int]]:
        with ServiceLoader(
            service.endpoint, mode="broadcast", group="sweep", group_size=4, timeout=30
        ) as loader:
            return [epoch_indices(loader)[0] for _ in range(2)]

    results = in_threads([member] * 4)
    for epochs in results:
        for seen in epochs:
            assert sorted(seen) == list(range(n))
        assert epochs == results[0], "members see the same batches in the same order"
    feed = status(service.endpoint)["feeds"][0]
    decoded = feed["decoded"] - feed["warm_decoded"]  # the warm start decodes for shard trainers only
    assert decoded == 2 * n, f"{decoded} decodes for 2 epochs of {n} images across 4 members"


def test_broadcast_waits_for_group_size_before_the_first_batch(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos)
    with (
        ServiceLoader(service.endpoint, mode="broadcast", group="g", group_size=2, timeout=1.5) as first,
        pytest.raises(ServiceError, match="no batch within"),
    ):
        next(iter(first))


def test_killed_broadcast_member_does_not_stall_the_rest(photos: Path, start_service: ServiceFactory) -> None:
    client_timeout = 3.0
    service = start_service(photos, batch_size=4, slots=6, client_timeout=client_timeout)
    doomed = trainer_process(service.endpoint, DIE_AFTER, "2", "broadcast")

    def survivor() -> tuple[int, float]:
        """Images, and the longest wait between two batches: from the first batch on, since the
        group's first waits for all three members, the doomed one's process start included (6.2 s
        on a loaded two-core machine, which this test once counted as a stall)."""
        with ServiceLoader(service.endpoint, mode="broadcast", group="g", group_size=3, timeout=30) as loader:
            images, gap, last = 0, 0.0, None
            for batch in loader:
                now = time.monotonic()
                gap, last = gap if last is None else max(gap, now - last), now
                images += len(batch.indices)
            return images, gap

    try:
        results = in_threads([survivor, survivor])
    finally:
        doomed.kill()
        out, _ = doomed.communicate(timeout=30)
    assert "dying" in out
    for images, gap in results:
        assert images == len(build_index(photos))
        assert gap < client_timeout + 3, f"survivors stalled {gap:.1f} s"


def test_member_that_stops_consuming_is_evicted_after_lag_timeout(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=4, slots=6, lag_timeout=2)
    with ServiceLoader(
        service.endpoint, mode="broadcast", group="g", group_size=2, credits=3, timeout=30
    ) as slow:

        def fast() -> int:
            with ServiceLoader(
                service.endpoint, mode="broadcast", group="g", group_size=2, timeout=30
            ) as loader:
                return sum(len(b.indices) for b in loader)

        stuck = iter(slow)
        box: list[Any] = []

        def take_one() -> None:
            batch = next(stuck)
            box.extend([batch, batch.images.clone()])

        starter = threading.Thread(target=take_one)
        starter.start()  # the slow member starts the epoch, takes one batch, then never asks again
        (images,) = in_threads([fast])
        starter.join(30)
        assert images == len(build_index(photos)), "the group went on without the slow member"
        held, copy = box
        assert held.images.equal(copy), "an evicted member keeps the slots it still holds"
        with pytest.raises(ServiceError, match="evicted"):
            next(stuck)
    assert "evicted" in service.log


# --- resume ------------------------------------------------------------------------------------


RESUMABLE = """
import json, os, signal, sys
from gpu_worker import ServiceLoader
endpoint, ckpt, die_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = []
with ServiceLoader(endpoint, timeout=30) as loader:
    if os.path.exists(ckpt):
        saved = json.load(open(ckpt))
        loader.load_state_dict(saved["loader"])
        seen = saved["seen"]
    for i, batch in enumerate(loader):
        seen += batch.indices.tolist()
        tmp = ckpt + ".tmp"
        json.dump({"loader": loader.state_dict(), "seen": seen}, open(tmp, "w"))
        os.replace(tmp, ckpt)
        if i + 1 == die_after:
            os.kill(os.getpid(), signal.SIGKILL)
print(json.dumps(seen))
"""


@pytest.mark.parametrize(
    "source", ["imagefolder", "tar", "jsonl", "parquet", "arrow", "s3-tar", "s3-parquet", "s3-zip"]
)
def test_trainer_killed_mid_epoch_resumes_from_its_state(
    photo_sources: dict[str, Path],
    start_service: ServiceFactory,
    tmp_path: Path,
    source: str,
    data_of: SourceData,
) -> None:
    """``s3-*``: the same data in a real S3 server (testkit/s3server.py)."""
    photos = photo_sources["imagefolder"]
    data, env = data_of(source)
    service = start_service(data, batch_size=8, client_timeout=3, env=env)
    ckpt = str(tmp_path / "ckpt.json")
    first = trainer_process(service.endpoint, RESUMABLE, ckpt, "5")
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    state = json.loads(Path(ckpt).read_text())
    assert state["loader"]["epoch"] == 0 and state["loader"]["consumed"] == 5 * 8
    assert len(state["seen"]) == 5 * 8
    second = trainer_process(service.endpoint, RESUMABLE, ckpt, "0")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    seen = json.loads(out)
    assert sorted(seen) == list(range(len(build_index(photos)))), "each image exactly once across both runs"


def test_set_epoch_after_load_state_dict_keeps_the_resume_point(
    photos: Path, start_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """NOTE [ Resume through set_epoch ]: the loop a DistributedSampler user writes calls
    ``set_epoch`` at the top of the resumed epoch; the state taken after 2 batches must still
    continue with the third (before the fix the epoch started again: 16 images twice)."""
    n = len(build_index(photos))
    service = start_service(photos, batch_size=8)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        loader.set_epoch(3)
        first = iter(loader)
        before = [i for _ in range(2) for i in next(first).indices.tolist()]
        state = loader.state_dict()
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        loader.load_state_dict(json.loads(json.dumps(state)))
        loader.set_epoch(state["epoch"])  # the top of the resumed epoch, as a DDP loop does
        after = [i for batch in loader for i in batch.indices.tolist()]
    assert sorted(before + after) == list(range(n)), "each image of the resumed epoch exactly once"
    assert after == epoch_permutation(0, 3, n)[len(before) :].tolist()
    with ServiceLoader(service.endpoint, timeout=30) as loader, caplog.at_level("WARNING"):
        loader.load_state_dict(state)
        loader.set_epoch(4)
        assert "drops the resume point loaded for epoch 3" in caplog.text
        assert sorted(i for batch in loader for i in batch.indices.tolist()) == list(range(n))


def test_a_checkpoint_epoch_beyond_the_protocol_is_refused_where_it_is_loaded(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Before: accepted, then a timeout or OverflowError 30 s later when the start was refused."""
    service = start_service(photos, batch_size=8)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        state = {**loader.state_dict(), "epoch": 2**40}
        with pytest.raises(ValueError, match="invalid epoch"):
            loader.load_state_dict(state)
        with pytest.raises(ValueError, match="epoch must be an integer"):
            loader.set_epoch(2**41)


def test_state_from_another_seed_or_dataset_is_refused(photos: Path, start_service: ServiceFactory) -> None:
    a = start_service(photos, seed=1, name="a")
    b = start_service(photos, seed=2, name="b")
    with ServiceLoader(a.endpoint, timeout=30) as loader:
        state = loader.state_dict()
    with ServiceLoader(b.endpoint, timeout=30) as other, pytest.raises(ValueError, match="seed: state has 1"):
        other.load_state_dict(state)
    with (
        ServiceLoader(a.endpoint, mode="broadcast", group="g", timeout=30) as other,
        pytest.raises(ValueError, match="mode: state has 'shard'"),
    ):
        other.load_state_dict(state)
    json.dumps(state)  # JSON-serialisable


def test_state_from_the_same_photos_in_another_source_is_refused(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """Same images, same order, same labels: still another dataset to a checkpoint (its paths differ),
    so resuming on it could silently repeat or skip samples after the sources drift apart."""
    shards = start_service(photo_sources["tar"], name="tar")
    folder = start_service(photo_sources["imagefolder"], name="folder")
    with ServiceLoader(shards.endpoint, timeout=30) as loader:
        state = loader.state_dict()
    with ServiceLoader(folder.endpoint, timeout=30) as other, pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)


# --- feeds and geometry ------------------------------------------------------------------------


def test_several_feeds_in_one_service(photos: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/feeds.sock"
    cfg = tmp_path / "svc.toml"
    cfg.write_text(
        f'data = "{photos}"\nendpoint = "{endpoint}"\nbatch_size = 8\nimage_size = 32\nworkers = 2\n'
        f'[feeds.val]\ndata = "{photos}"\naugment = "eval"\nimage_size = 48\nbatch_size = 5\n'
    )
    service = ServiceProcess(["serve", "--config", str(cfg)], endpoint)
    try:
        with (
            ServiceLoader(endpoint, timeout=30, connect_timeout=30) as train,
            ServiceLoader(endpoint, feed="val", timeout=30) as val,
        ):
            assert train.info.name == "train" and val.info.name == "val" and val.info.augment == "eval"
            t, v = next(iter(train)), next(iter(val))
            assert tuple(t.images.shape) == (8, 3, 32, 32) and tuple(v.images.shape) == (5, 3, 48, 48)
            del t, v
        assert service.stop() == 0
    finally:
        service.kill_group()


def test_attaching_with_the_wrong_geometry_is_a_clear_error(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=8, image_size=32)
    with pytest.raises(ServiceError, match="serves batches of 8 samples of 32px images"):
        ServiceLoader(service.endpoint, batch_size=64, image_size=224, connect_timeout=10)
    with ServiceLoader(service.endpoint, batch_size=8, image_size=32, connect_timeout=10) as ok:
        assert len(ok) > 0


# --- fields --------------------------------------------------------------------------------------


def test_a_trainer_that_states_the_feeds_fields_gets_them_by_name_and_in_order(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=8, image_size=32)
    fields = {"image": ((3, 32, 32), torch.uint8), "label": ((), torch.int64)}
    with ServiceLoader(service.endpoint, fields=fields, timeout=30, connect_timeout=10) as loader:
        assert loader.fields == fields
        batch = next(iter(loader))
        images, labels = batch
        assert list(batch.keys()) == ["image", "label"] and images is batch["image"] is batch.images
        assert tuple(images.shape) == (8, 3, 32, 32) and labels.dtype == torch.int64
        assert labels.tolist() == [build_index(photos).labels[i] for i in batch.indices.tolist()]
        del batch, images, labels


def test_a_trainer_expecting_other_fields_is_told_every_difference_before_any_batch(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=8, image_size=32)
    expected = {"image": ((3, 224, 224), torch.float16), "mask": ((32, 32), torch.bool)}
    with pytest.raises(ServiceError) as refused:
        ServiceLoader(service.endpoint, fields=expected, connect_timeout=10)
    message = str(refused.value)
    for difference in (
        "missing field mask bool[32, 32]",
        "extra field label int64[]",
        "image: shape [3, 32, 32], expected [3, 224, 224]",
        "image: dtype uint8, expected float16",
        "it serves image uint8[3, 32, 32], label int64[]",
    ):
        assert difference in message
    assert not any(s["leased"] for s in status(service.endpoint)["sessions"]), "it took no batch"
    with ServiceLoader(service.endpoint, connect_timeout=10) as ok:  # the service is unharmed
        assert ok.fields == {"image": ((3, 32, 32), torch.uint8), "label": ((), torch.int64)}


@pytest.mark.parametrize(("before", "steps", "after"), [(4, 3, 2), (2, 5, 3)])
def test_any_ranks_state_resumes_a_job_of_another_world_size_exactly_once(
    photos: Path, start_service: ServiceFactory, before: int, steps: int, after: int
) -> None:
    """4 ranks take 3 batches of 4 each (48 samples), or 2 ranks 5 each (40); the last rank's state
    resumes a job of 2, or 3, ranks: across both jobs every sample once, but for the few the new
    job's ``remainder="drop"`` leaves out, which are the epoch order's last ones."""
    n = len(build_index(photos))
    service = start_service(photos, batch_size=4, workers=2)
    first, state = job_steps(service.endpoint, before, steps)
    assert state["consumed"] == steps * 4 * before and "rank" not in state
    rest, end_state = job_steps(service.endpoint, after, -1, state)
    order = epoch_permutation(0, 0, n).tolist()
    left_out = (n - state["consumed"]) % after
    assert sorted(first + rest) == sorted(order[: n - left_out])
    assert (end_state["epoch"], end_state["consumed"]) == (1, 0), "the next state begins the next epoch"


@pytest.mark.parametrize("after", [2, 3])
def test_a_version_1_state_still_resumes_its_job(
    photos: Path, start_service: ServiceFactory, after: int
) -> None:
    """A state saved before states named the job's progress (rank 1 of 2, after 3 batches): it
    named a rank's position, and ranks moved in step, so it loads as the prefix its job had taken,
    for a job of the same size or another."""
    service = start_service(photos, batch_size=4)
    with ServiceLoader(service.endpoint, rank=1, world_size=2, timeout=30) as loader:
        identity = {k: v for k, v in loader.state_dict().items() if k not in ("version", "epoch", "consumed")}
    old = {
        **identity,
        "version": 1,
        "epoch": 0,
        "position": 3,
        "rank": 1,
        "world_size": 2,
        "remainder": "pad",
    }
    first, _ = job_steps(service.endpoint, 2, 3)
    rest, _ = job_steps(service.endpoint, after, -1, old)  # 90 - 24 leaves a multiple of 2 and 3
    assert sorted(first + rest) == list(range(len(build_index(photos))))
