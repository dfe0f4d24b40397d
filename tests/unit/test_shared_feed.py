"""NOTE [ A shared service for a local call ]: what ``ServiceLoader.local`` compares with a shared
feed's welcome, and what it leaves to the shared service."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpu_worker.local import served_differently
from protocol.layout import SlotLayout
from protocol.messages import FeedInfo

FEED = FeedInfo(
    "train",
    90,
    3,
    8,
    32,
    12,
    1,
    "eval",
    "ab" * 16,
    "dataferry-1-train-0",
    12,
    SlotLayout.images(8, 32).wire(),
    decoding="max-pixels=0 max-file-bytes=0 interpolation=area dct-scaling=off",
    data="/data/train",
)


def test_options_not_given_are_not_compared_and_the_same_data_attaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_differently(FEED, "/data/train", {}) == []
    assert served_differently(FEED, "/data/train", {"seed": None, "workers": 3, "slots": 64}) == []
    assert served_differently(FEED, "/data/train", {"seed": "1", "augment": "eval"}) == [], "as flags"
    monkeypatch.chdir(tmp_path)
    feed = replace(FEED, data=str(tmp_path / "train"))
    assert served_differently(feed, "train", {"interpolation": "area"}) == [], "made absolute, as served"


def test_each_difference_is_named_with_what_is_served() -> None:
    asked = {"seed": 2, "augment": "train", "interpolation": "bilinear"}
    assert served_differently(FEED, "/data/other", asked) == [
        "data '/data/other' (it serves '/data/train')",
        "seed 2 (it serves 1)",
        "augment 'train' (it serves 'eval')",
        "interpolation 'bilinear' (it serves 'area')",
    ]


def test_a_store_url_is_compared_as_given_and_sources_are_not_data() -> None:
    feed = replace(FEED, data="s3://bucket/shards")
    assert served_differently(feed, "s3://bucket/shards/", {}) == []
    assert served_differently(feed, "s3://bucket/other", {}) == [
        "data 's3://bucket/other' (it serves 's3://bucket/shards')"
    ]
    mixed = replace(FEED, data="", sources=("web", "books"))
    assert served_differently(mixed, "/data/train", {}) == [
        "data '/data/train' (it serves 'sources web, books')"
    ]


def test_a_pipeline_is_compared_by_its_file_and_its_feed_has_no_transform_to_compare(tmp_path: Path) -> None:
    spec = f"{tmp_path / 'aug.py'}:train"
    feed = replace(FEED, augment="pipeline", pipeline=spec, decoding="max-pixels=0 max-file-bytes=0")
    assert served_differently(feed, "/data/train", {"pipeline": spec, "augment": "train"}) == []
    assert served_differently(feed, "/data/train", {"pipeline": f"{tmp_path / 'other.py'}:train"}) == [
        f"pipeline '{tmp_path / 'other.py'}:train' (it serves '{spec}')"
    ]
    assert served_differently(feed, "/data/train", {"augment": "train"}) == [
        "augment 'train' (it serves 'pipeline')"
    ]
    assert served_differently(FEED, "/data/train", {"pipeline": spec}) == [
        f"pipeline '{spec}' (it serves 'none: the built-in transforms')"
    ]
