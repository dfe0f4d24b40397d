"""A feed's sources (NOTE [ Sources of a feed ]): several indexes of real files numbered one after
another, read by feed number, saved and mapped back; one source exactly as its index alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.sources import SOURCES_FILE, FeedSources
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import FeedReader, SampleReader

NAMES = ("folder", "shards", "list")


@pytest.fixture(scope="module")
def three(photo_sources: dict[str, Path]) -> FeedSources:
    kinds = ("imagefolder", "tar", "csv")
    return FeedSources(NAMES, tuple(build_index(photo_sources[k]) for k in kinds))


def test_samples_are_numbered_source_after_source(three: FeedSources) -> None:
    sizes = [len(index) for index in three.indexes]
    assert len(three) == sum(sizes) and three.offsets.tolist() == [
        0,
        sizes[0],
        sizes[0] + sizes[1],
        sum(sizes),
    ]
    every = np.arange(len(three), dtype=np.int64)
    source, local = three.split(every)
    assert [three.locate(i) for i in (0, sizes[0] - 1, sizes[0], len(three) - 1)] == [
        (0, 0),
        (0, sizes[0] - 1),
        (1, 0),
        (2, sizes[2] - 1),
    ]
    assert list(zip(source.tolist(), local.tolist(), strict=True)) == [
        three.locate(i) for i in every.tolist()
    ]
    for i in (0, sizes[0] + 5, len(three) - 1):
        s, j = three.locate(i)
        assert three.labels[i] == three.indexes[s].labels[j], "each source's own classes"
        assert three.relpath(i) == f"{NAMES[s]}:{three.indexes[s].relpath(j)}"
        assert three.path(i) == three.indexes[s].path(j)
    assert three.kind == "imagefolder+tar+list"
    assert three.num_classes == max(index.num_classes for index in three.indexes)


def test_a_feed_sample_is_read_from_its_own_source(three: FeedSources) -> None:
    reader = FeedReader(three, 1 << 28)
    alone = [SampleReader(index, 1 << 28) for index in three.indexes]
    try:
        for i in (3, int(three.offsets[1]) + 7, int(three.offsets[2]) + 2):
            s, j = three.locate(i)
            assert reader.image_bytes(i) == alone[s].image_bytes(j)
        reader.prefetch([0, int(three.offsets[2]) + 1, len(three) + 5])  # local data: nothing to fetch
        assert set(reader.metadata(int(three.offsets[2]))) == set(alone[2].metadata(0))
    finally:
        reader.close()
        for r in alone:
            r.close()


def test_saved_sources_map_back_the_same(three: FeedSources, tmp_path: Path) -> None:
    three.save(tmp_path)
    loaded = FeedSources.load(tmp_path)
    assert loaded.names == NAMES and len(loaded) == len(three)
    assert loaded.fingerprint() == three.fingerprint()
    assert np.array_equal(loaded.labels, three.labels)
    assert [loaded.relpath(i) for i in range(0, len(three), 7)] == [
        three.relpath(i) for i in range(0, len(three), 7)
    ]


def test_the_fingerprint_of_several_says_which_sources_in_which_order(three: FeedSources) -> None:
    swapped = FeedSources(
        (NAMES[1], NAMES[0], NAMES[2]), (three.indexes[1], three.indexes[0], three.indexes[2])
    )
    renamed = FeedSources(("a", "b", "c"), three.indexes)
    prints = {three.fingerprint(), swapped.fingerprint(), renamed.fingerprint()}
    assert len(prints) == 3


def test_one_source_is_its_index_alone(photo_sources: dict[str, Path], tmp_path: Path) -> None:
    """Numbers, names, labels, fingerprint and saved files as the index's: a checkpoint or a saved
    folder of a single-source feed stays valid."""
    index = build_index(photo_sources["tar"])
    one = FeedSources.one("data", index)
    assert one.fingerprint() == index.fingerprint()
    assert [one.relpath(i) for i in range(5)] == [index.relpath(i) for i in range(5)]
    assert one.labels is index.labels and one.kind == index.kind and len(one) == len(index)
    one.save(tmp_path)
    assert DatasetIndex.load(tmp_path).fingerprint() == index.fingerprint(), "the index's own files"
    plain = tmp_path / "plain"
    plain.mkdir()
    index.save(plain)
    assert not (plain / SOURCES_FILE).exists()
    assert (
        FeedSources.load(plain).names == ("data",)
        and FeedSources.load(plain).fingerprint() == index.fingerprint()
    )


def test_names_and_indexes_must_pair(three: FeedSources) -> None:
    with pytest.raises(DatasetError, match="one index per source"):
        FeedSources(("a",), three.indexes)
    with pytest.raises(DatasetError, match="one index per source"):
        FeedSources((), ())
