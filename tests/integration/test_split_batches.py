"""A cold first batch decoded by every worker at once (NOTE [ Split batches ]), through a real service.

Each test attaches one trainer with a plan the warm start never serves (``remainder="drop"``), once
the service is idle. Its first batch must be decoded in parts by both workers (the service logs each
part at DEBUG), and must be the batch a single worker decodes whole, pixel for pixel, with every
pixel the transform's output for the index in its row.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.dataset.sampler import sample_rng
from loader_service.decode.transforms import Recipe, load_into
from tests.helpers import ServiceFactory, ServiceProcess, status

pytestmark = pytest.mark.integration

BATCH = 32
SIZE = 32
SEED = 4
SETTINGS = {
    "batch_size": BATCH,
    "image_size": SIZE,
    "seed": SEED,
    "decoder": "opencv",
    "interpolation": "area",
    "log_level": "DEBUG",
}
WARM = r"warm start: batch \d+ of epoch 0 of feed '\w+' ready \(warm\)"
FIRST_PART = r"batch 0 of epoch 0 \(stream\): part from row (\d+), (\d+) rows by worker (\d+)"


@dataclass
class FirstBatch:
    indices: list[int]
    labels: list[int]
    images: np.ndarray
    splits: int
    """Batches split from the trainer's attach to its first batch."""


def first_batch(service: ServiceProcess) -> FirstBatch:
    """The first batch of a cold trainer, once the service is idle: both warm batches decoded."""
    service.wait_for(WARM, count=2)
    before = status(service.endpoint)["feeds"][0]["split_batches"]
    # 4 credits, twice the workers: batches after the first are not cut (NOTE [ Split batches ]).
    with ServiceLoader(service.endpoint, remainder="drop", credits=4, timeout=30) as loader:
        batch = next(iter(loader))
        # Still held, and the next batch is planned whole: no other batch can be split meanwhile.
        after = status(service.endpoint)["feeds"][0]["split_batches"]
        got = FirstBatch(
            batch.indices.tolist(), batch.labels.tolist(), batch.images.numpy().copy(), after - before
        )
        del batch
    return got


def parts(service: ServiceProcess) -> list[tuple[int, int, int]]:
    """(first row, rows written, worker) of each part of the trainer's first batch, in row order."""
    service.wait_for(FIRST_PART, count=2)
    found = [re.search(FIRST_PART, line) for line in service.lines]
    return sorted((int(m[1]), int(m[2]), int(m[3])) for m in found if m is not None)


def check_pixels(data: Path, got: FirstBatch) -> None:
    """Every row holds the train transform's output for the index beside it, and its label."""
    index = build_index(data)
    recipe = Recipe("train", "area", False)
    assert got.labels == [int(index.labels[i]) for i in got.indices]
    for row, idx in enumerate(got.indices):
        expected = np.empty((3, SIZE, SIZE), np.uint8)
        load_into(str(index.path(idx)), expected, recipe, sample_rng(SEED, 0, idx))
        np.testing.assert_array_equal(got.images[row], expected, err_msg=f"row {row}, sample {idx}")


def whole(data: Path, start_service: ServiceFactory) -> FirstBatch:
    """The same first batch from a service with one worker, which cannot split it."""
    service = start_service(data, workers=1, name="whole", **SETTINGS)
    got = first_batch(service)
    assert got.splits == 0 and re.search(FIRST_PART, service.log) is None
    assert service.stop() == 0
    return got


def test_a_cold_first_batch_is_decoded_by_both_workers(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, workers=2, name="split", **SETTINGS)
    got = first_batch(service)
    assert got.splits == 1
    found = parts(service)
    assert [(row, rows) for row, rows, _ in found] == [(0, BATCH // 2), (BATCH // 2, BATCH // 2)]
    assert {worker for _, _, worker in found} == {0, 1}, "each worker decoded one half"
    assert service.stop() == 0
    reference = whole(photos, start_service)
    assert got.indices == reference.indices and len(set(got.indices)) == BATCH
    np.testing.assert_array_equal(got.images, reference.images)
    check_pixels(photos, got)


@pytest.fixture
def with_bad_files(photos: Path, tmp_path: Path) -> Path:
    """40 of the photos and 24 undecodable files among them."""
    root = tmp_path / "with_bad"
    for k, src in enumerate(sorted(photos.rglob("*.jpg"))[:40]):
        dest = root / src.parent.name / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        if k < 24:
            (dest.parent / f"bad_{k:02d}.jpg").write_bytes(b"\xff\xd8 not a jpeg " * (k + 1))
    return root


def test_bad_files_in_both_parts_leave_no_gap_in_the_batch(
    with_bad_files: Path, start_service: ServiceFactory
) -> None:
    service = start_service(with_bad_files, workers=2, name="split", **SETTINGS)
    got = first_batch(service)
    assert got.splits == 1
    found = parts(service)
    written = [rows for _, rows, _ in found]
    assert len(found) == 2 and all(0 < n < BATCH // 2 for n in written), (
        f"premise: bad and good files in both halves of the first batch, got {found}; change SEED"
    )
    assert {worker for _, _, worker in found} == {0, 1}
    assert len(got.indices) == sum(written), "every written row delivered, and no stale one"
    assert service.stop() == 0
    index = build_index(with_bad_files)
    assert not [i for i in got.indices if index.path(i).name.startswith("bad_")]
    reference = whole(with_bad_files, start_service)
    assert got.indices == reference.indices, "the good samples of the plan, in plan order"
    np.testing.assert_array_equal(got.images, reference.images)
    check_pixels(with_bad_files, got)


def test_a_part_that_hangs_its_worker_loses_only_the_sample_it_hung_on(
    photos: Path, start_service: ServiceFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One batch of 16 per epoch, always split in two: the part holding the stuck file hangs its
    # worker once and is redone without it (NOTE [ Per-sample progress ]); the batch has the 15.
    data = tmp_path / "stuck"
    (data / "a").mkdir(parents=True)
    good = sorted(photos.rglob("*.jpg"))[:15]
    for p in good:
        shutil.copyfile(p, data / "a" / p.name)
    shutil.copyfile(good[0], data / "a" / "stuck.jpg")
    monkeypatch.setenv("DATAFERRY_INJECT_FAULT", "hang-on:a/stuck.jpg")
    service = start_service(data, workers=2, task_timeout=1.5, **{**SETTINGS, "batch_size": 16})
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        batch = next(iter(loader))
        got = FirstBatch(batch.indices.tolist(), batch.labels.tolist(), batch.images.numpy().copy(), 1)
        del batch
    service.wait_for(r"a/stuck.jpg: its decode worker finished nothing for over 2 s")
    assert len(got.indices) == 15, "every sample but the stuck one, both parts"
    index = build_index(data)
    assert not [i for i in got.indices if index.path(i).name == "stuck.jpg"]
    check_pixels(data, got)
