"""A feed of several named sources through a real service (``--source NAME=DATA``, NOTE [ Sources of
a feed ]): an epoch holds every sample of every source once, each row says its source and its sample
there, and a bad file is named with its source."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from tests.helpers import ServiceFactory, status

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
