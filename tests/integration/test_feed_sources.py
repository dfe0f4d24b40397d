"""A feed of several named sources through a real service (``--source NAME=DATA``, NOTE [ Sources of
a feed ]): an epoch holds every sample of every source once, each row says its source and its sample
there, and a bad file is named with its source."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from tests.helpers import ServiceFactory, in_threads, status

if TYPE_CHECKING:
    from testkit.s3server import S3Server

pytestmark = pytest.mark.integration

NAMES = ("folder", "shards", "list")
KINDS = ("imagefolder", "tar", "csv")


def test_an_epoch_is_every_sample_of_every_source_once(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(None, source=flags, batch_size=16)
    indexes = [build_index(photo_sources[kind]) for kind in KINDS]
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        assert loader.sources == NAMES
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
