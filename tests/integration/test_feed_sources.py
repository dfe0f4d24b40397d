"""A feed of several named sources through a real service (``--source NAME=DATA``, NOTE [ Sources of
a feed ]): an epoch holds every sample of every source once, each row says its source and its sample
there, and a bad file is named with its source."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpu_worker import ServiceError, ServiceLoader
from loader_service.dataset.index import build_index
from tests.helpers import ServiceFactory, in_threads, job_steps, status

if TYPE_CHECKING:
    from testkit.s3server import S3Server

pytestmark = pytest.mark.integration

NAMES = ("folder", "shards", "list")
KINDS = ("imagefolder", "tar", "csv")


def test_an_epoch_is_every_sample_of_every_source_once(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    names, kinds = (*NAMES, "archive"), (*KINDS, "zip")
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(names, kinds, strict=True)]
    service = start_service(None, source=flags, batch_size=16)
    indexes = [build_index(photo_sources[kind]) for kind in kinds]
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        assert loader.sources == names
        assert loader.info.samples == sum(len(i) for i in indexes)
        seen: Counter[tuple[int, int]] = Counter()
        for batch in loader:
            for source, index, label in zip(
                batch.sources.tolist(), batch.indices.tolist(), batch.labels.tolist(), strict=True
            ):
                seen[(source, index)] += 1
                assert label == int(indexes[source].labels[index]), "the label of that sample of that source"
    expected = {(s, i) for s, index in enumerate(indexes) for i in range(len(index))}
    assert set(seen) == expected and max(seen.values()) == 1, "every sample of every source, once"
    feed = status(service.endpoint)["feeds"][0]
    assert feed["samples"] == len(expected)
    assert service.stop() == 0


def test_a_bad_file_is_named_with_its_source(
    photos: Path, photo_sources: dict[str, Path], tmp_path: Path, start_service: ServiceFactory
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(photos, damaged)
    victim = sorted(damaged.rglob("*.jpg"))[0]
    victim.write_bytes(b"not a jpeg at all")
    service = start_service(
        None, source=[f"clean={photo_sources['tar']}", f"damaged={damaged}"], batch_size=16
    )
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        rows = sum(len(batch.indices) for batch in loader)
    assert rows == loader.info.samples - 1, "one sample lost, nothing else"
    service.wait_for(rf"damaged:{victim.parent.name}/{victim.name}")
    assert service.stop() == 0


def test_a_feed_of_sources_that_cannot_be_served_is_refused_at_start(
    photo_sources: dict[str, Path], tmp_path: Path, start_service: ServiceFactory
) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("path,label\n")
    service = start_service(None, wait_ready=False, source=[f"ok={photo_sources['tar']}", f"nothing={empty}"])
    assert service.proc.wait(timeout=60) == 2
    assert "source nothing:" in service.log


def test_a_source_in_an_object_store_beside_a_local_one(
    s3_server: S3Server,
    s3_sources: dict[str, str],
    photo_sources: dict[str, Path],
    start_service: ServiceFactory,
) -> None:
    """A real S3 server's Parquet files and local shards in one feed: each row read from its own
    source, the store's by its own format detection."""
    service = start_service(
        None,
        env=s3_server.env(),
        source=[f"local={photo_sources['tar']}", f"remote_parquet={s3_sources['parquet']}"],
        batch_size=16,
    )
    local, stored = build_index(photo_sources["tar"]), build_index(photo_sources["parquet"])
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        seen = Counter(
            (s, i)
            for batch in loader
            for s, i in zip(batch.sources.tolist(), batch.indices.tolist(), strict=True)
        )
    assert set(seen) == {(0, i) for i in range(len(local))} | {(1, i) for i in range(len(stored))}
    assert max(seen.values()) == 1
    assert status(service.endpoint)["feeds"][0]["format"] == "tar+parquet"
    assert service.stop() == 0


def pairs(loader: ServiceLoader) -> list[tuple[int, int]]:
    return [
        (s, i)
        for batch in loader
        for s, i in zip(batch.sources.tolist(), batch.indices.tolist(), strict=True)
    ]


def test_ddp_ranks_and_a_broadcast_group_read_a_feed_of_sources_as_any_feed(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """Two ranks share an epoch of three sources without overlap; two members of a broadcast group
    each get the same whole epoch."""
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(None, source=flags, batch_size=16)
    total = sum(len(build_index(photo_sources[kind])) for kind in KINDS)
    endpoint = service.endpoint
    with (
        ServiceLoader(endpoint, rank=0, world_size=2, remainder="drop", timeout=60) as first,
        ServiceLoader(endpoint, rank=1, world_size=2, remainder="drop", timeout=60) as second,
    ):
        a, b = pairs(first), pairs(second)
    assert not set(a) & set(b) and len(a) + len(b) == total - total % 2, "disjoint shares of one epoch"

    def member() -> list[tuple[int, int]]:
        with ServiceLoader(endpoint, mode="broadcast", group="g", group_size=2, timeout=60) as loader:
            return pairs(loader)

    got_one, got_two = in_threads([member] * 2)
    assert got_one == got_two and len(set(got_one)) == total, "every member, every sample, the same order"
    assert service.stop() == 0


# --- weights chosen by each job (NOTE [ Mixture order ]) -------------------------------------------


def rows_of(loader: ServiceLoader) -> list[tuple[int, int]]:
    """(source, sample) of every row of one epoch, in the order delivered."""
    return pairs(loader)


def check_shares(rows: list[tuple[int, int]], weights: list[float]) -> None:
    """Every prefix within Tijdeman's bound of each weight's share (1 - 1/(2k-2))."""
    k, total = len(weights), sum(weights)
    counts = [0] * k
    bound = 1 - 1 / (2 * k - 2)
    for n, (source, _) in enumerate(rows, start=1):
        counts[source] += 1
        for s in range(k):
            assert abs(counts[s] - weights[s] / total * n) <= bound + 1e-9, (n, s, counts)


def test_a_jobs_weights_mix_its_epoch_and_another_job_mixes_its_own(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """Two trainers on one service at once, each with its own weights and epoch length: shares
    exact in every prefix, every sample of a source once per pass (the small share wraps nothing,
    the large one wraps), and the feed's own order untouched for a third trainer without weights."""
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(None, source=flags, batch_size=16)
    sizes = [len(build_index(photo_sources[kind])) for kind in KINDS]
    first_weights = {"folder": 0.6, "shards": 0.3, "list": 0.1}
    second_weights = {"folder": 0.0, "shards": 1.0, "list": 1.0}
    epoch = 2 * sum(sizes)
    with (
        ServiceLoader(service.endpoint, weights=first_weights, epoch_samples=epoch, timeout=60) as one,
        ServiceLoader(service.endpoint, weights=second_weights, epoch_samples=64, timeout=60) as two,
    ):
        assert one.info.samples == epoch and len(one) == -(-epoch // 16)
        first = rows_of(one)
        second = rows_of(two)
        again = rows_of(one)  # the next epoch goes on where the passes stand
    assert len(first) == epoch and len(second) == 64
    check_shares(first, list(first_weights.values()))
    check_shares(second, list(second_weights.values()))
    assert {s for s, _ in second} == {1, 2}, "a weight of 0 draws nothing"
    for s, size in enumerate(sizes):
        drawn = [i for source, i in first + again if source == s]
        for p in range(len(drawn) // size):
            assert sorted(drawn[p * size : (p + 1) * size]) == list(range(size)), f"source {s}, pass {p}"
    with ServiceLoader(service.endpoint, timeout=60) as plain:
        assert sorted(pairs(plain)) == sorted((s, i) for s, size in enumerate(sizes) for i in range(size))
    assert service.stop() == 0


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"folder": 1.0, "shards": 1.0}, "missing list"),
        ({"folder": 1.0, "shards": 1.0, "list": 1.0, "other": 1.0}, "unknown other"),
        ({"folder": 0.0, "shards": 0.0, "list": 0.0}, "weights are all zero"),
    ],
)
def test_weights_the_feed_cannot_serve_are_refused_by_name(
    photo_sources: dict[str, Path], start_service: ServiceFactory, weights: dict[str, float], message: str
) -> None:
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(None, source=flags, batch_size=16)
    with pytest.raises(ServiceError, match=message):
        ServiceLoader(service.endpoint, weights=weights, connect_timeout=10)
    assert service.stop() == 0


def test_weights_on_a_feed_of_one_dataset_are_refused(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos)
    with pytest.raises(ServiceError, match="weights need named sources"):
        ServiceLoader(service.endpoint, weights={"data": 1.0}, connect_timeout=10)
    with pytest.raises(ValueError, match="weight of 'data' must be a finite number"):
        ServiceLoader(service.endpoint, weights={"data": float("nan")}, connect_timeout=10)
    assert service.stop() == 0


def source_rows(batch: Any) -> list[tuple[int, int]]:
    return list(zip(batch.sources.tolist(), batch.indices.tolist(), strict=True))


def test_a_weighted_job_resumes_at_another_world_size_exactly_once(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """2 ranks take 3 batches of 8 each; the last rank's state resumes the mixture with 3 ranks: across
    both jobs every position of the epoch once (but the few the new job's ``drop`` leaves out, the
    epoch's last). A loader with other weights refuses that state."""
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(None, source=flags, batch_size=8)
    weights, epoch = {"folder": 0.2, "shards": 0.5, "list": 0.3}, 200
    with ServiceLoader(service.endpoint, weights=weights, epoch_samples=epoch, timeout=60) as whole:
        sequence = rows_of(whole)
    mixture = {"weights": weights, "epoch_samples": epoch}
    first, state = job_steps(service.endpoint, 2, 3, None, source_rows, **mixture)
    assert state["consumed"] == 48
    rest, _ = job_steps(service.endpoint, 3, -1, state, source_rows, **mixture)
    left_out = (epoch - 48) % 3
    assert sorted(first + rest) == sorted(sequence[: epoch - left_out])
    other = ServiceLoader(
        service.endpoint, weights={**weights, "folder": 0.9}, epoch_samples=epoch, timeout=60
    )
    with other, pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)
    assert service.stop() == 0
