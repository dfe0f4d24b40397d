"""A decode worker filling slots: the built-in transforms' pixels exactly as before, a pipeline's fields
in place, bad samples as data, and output that does not depend on the worker or the order.

Real files, a real shared-memory segment, and (for the worker-independence test) real spawned
processes, each with its own history of global generator draws.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import random
import tarfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from loader_service.dataset.index import build_index
from loader_service.dataset.sampler import sample_rng
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import uses_roi
from loader_service.decode.pipeline import PipelineError, call_pipeline
from loader_service.decode.sample import Sample
from loader_service.decode.transforms import load_into
from loader_service.decode.worker import OpenFeed, WorkerFeed, fill_slot, open_feed, slot_views
from loader_service.shm import Segment, new_segment_name
from protocol.layout import FieldSpec, SlotLayout
from protocol.workers import Task, TaskDone

pytestmark = pytest.mark.usefixtures("restore_process_state")

MAX_BYTES = 1 << 24
SEED = 5
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pipelines"

OpenTestFeed = Callable[..., OpenFeed]


@pytest.fixture
def open_test_feed(tmp_path: Path) -> Iterator[OpenTestFeed]:
    """``open_test_feed(data, layout, pipeline="", augment="train", roi=False)``: a pool with a worker's
    view of it."""
    cleanup: list[Callable[[], None]] = []

    def make(
        data: Path, layout: SlotLayout, pipeline: str = "", augment: str = "train", roi: bool = False
    ) -> OpenFeed:
        index_dir = tmp_path / f"index{len(cleanup)}"
        index_dir.mkdir()
        build_index(data).save(index_dir)
        pool = Segment.create(new_segment_name("fill-test"), layout.mapped_bytes(2))
        cleanup.extend([pool.unlink, pool.close])  # run in reverse
        feed = open_feed(worker_feed(pool.name, layout, index_dir, pipeline, augment), roi)
        cleanup.append(feed.close)
        return feed

    yield make
    for step in reversed(cleanup):
        step()


def worker_feed(segment: str, layout: SlotLayout, index_dir: Path, pipeline: str, augment: str) -> WorkerFeed:
    return WorkerFeed(
        segment=segment,
        slots=2,
        layout=layout,
        index_dir=index_dir,
        seed=SEED,
        augment=augment,
        interpolation=INTERPOLATIONS[0],
        pipeline=pipeline,
        max_file_bytes=MAX_BYTES,
    )


def task(indices: list[int], slot: int = 0, epoch: int = 1) -> Task:
    return Task(task=1, feed=0, slot=slot, epoch=epoch, indices=np.asarray(indices, "<i8").tobytes())


def fill(feed: OpenFeed, indices: list[int], slot: int = 0, epoch: int = 1) -> TaskDone:
    return fill_slot(0, feed, task(indices, slot, epoch))


def rows(feed: OpenFeed, slot: int = 0) -> dict[str, np.ndarray]:
    views = slot_views(feed.segment, feed.spec.layout, slot, feed.spec.slots)
    return {**views.fields, "indices": views.indices}


def encoded(bgr: np.ndarray, ext: str = ".png") -> bytes:
    ok, data = cv2.imencode(ext, bgr)
    assert ok
    return data.tobytes()


def pipeline_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "user_pipeline.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:fn"


# --- the built-in transforms ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("augment", "roi"), [("train", False), ("train", True), ("eval", False), ("eval", True), ("none", False)]
)
def test_builtin_rows_are_the_pixels_of_load_into(
    photos: Path, open_test_feed: OpenTestFeed, augment: str, roi: bool
) -> None:
    if roi and not uses_roi("auto"):
        pytest.skip("the region decoder is not built here")
    feed = open_test_feed(photos, SlotLayout.images(6, 40), augment=augment, roi=roi)
    indices = [17, 0, 44, 3, 89]
    done = fill(feed, indices, epoch=2)
    assert (done.count, done.bad) == (5, ())
    got = rows(feed)
    for row, i in enumerate(indices):
        expected = np.empty((3, 40, 40), np.uint8)
        load_into(str(feed.sources.path(i)), expected, feed.recipe, sample_rng(SEED, 2, i))
        assert np.array_equal(got["image"][row], expected), f"sample {i}"
        assert got["label"][row] == feed.sources.labels[i] and got["indices"][row] == i


def test_bad_files_and_stray_indices_are_reported_not_written(
    tmp_path: Path, open_test_feed: OpenTestFeed
) -> None:
    data = tmp_path / "data"
    (data / "c").mkdir(parents=True)
    (data / "c" / "0.png").write_bytes(encoded(np.full((20, 20, 3), 9, np.uint8)))
    (data / "c" / "1.jpg").write_bytes(b"\xff\xd8\xff truncated")
    (data / "c" / "2.png").write_bytes(encoded(np.full((20, 20, 3), 200, np.uint8)))
    feed = open_test_feed(data, SlotLayout.images(4, 8), augment="none")
    done = fill(feed, [2, 1, 7, 0])
    assert done.count == 2 and [i for i, _ in done.bad] == [1, 7]
    assert done.bad[1][1] == "index outside dataset"
    got = rows(feed)
    assert (
        got["indices"][:2].tolist() == [2, 0] and got["image"][0].max() == 200 and got["image"][1].max() == 9
    )


def test_the_builtin_transforms_refuse_a_layout_they_cannot_fill(tmp_path: Path, photos: Path) -> None:
    layout = SlotLayout(4, (FieldSpec("image", "float16", (3, 8, 8)), FieldSpec("label", "int64", ())))
    pool = Segment.create(new_segment_name("fill-test"), layout.mapped_bytes(2))
    try:
        with pytest.raises(ValueError, match="built-in transforms fill image uint8"):
            open_feed(worker_feed(pool.name, layout, tmp_path, "", "train"))
    finally:
        pool.close()
        pool.unlink()


# --- pipelines ------------------------------------------------------------------------------------

NUMPY_LAYOUT = SlotLayout(4, (FieldSpec("image", "float16", (3, 224, 224)), FieldSpec("label", "int64", ())))


def test_the_numpy_example_fills_its_fields_in_place(photos: Path, open_test_feed: OpenTestFeed) -> None:
    feed = open_test_feed(photos, NUMPY_LAYOUT, f"{EXAMPLES / 'numpy_aug.py'}:train")
    indices = [31, 2, 60]
    done = fill(feed, indices, epoch=3)
    assert (done.count, done.bad) == (3, ())
    got = rows(feed)
    assert feed.pipeline is not None
    for row, i in enumerate(indices):
        direct = call_pipeline(feed.pipeline, Sample(feed.reader, feed.sources, i, 3), SEED)
        assert isinstance(direct, dict)
        assert (
            np.array_equal(got["image"][row], direct["image"]) and got["label"][row] == feed.sources.labels[i]
        )
        assert abs(float(got["image"][row].mean())) < 3  # normalised, not raw pixels
    assert got["indices"][:3].tolist() == indices


def test_pipeline_failures_and_mismatches_are_bad_samples(
    tmp_path: Path, photos: Path, open_test_feed: OpenTestFeed
) -> None:
    spec = pipeline_file(
        tmp_path,
        """
        import numpy as np
        def fn(sample, rng):
            if sample["index"] == 1:
                raise ValueError(f"cannot use {sample['path']}")
            shape = (2, 3) if sample["index"] == 2 else (2, 2)
            return {"x": np.full(shape, sample["index"], np.int32), "label": sample["label"]}
        """,
    )
    layout = SlotLayout(4, (FieldSpec("x", "int32", (2, 2)), FieldSpec("label", "int64", ())))
    feed = open_test_feed(photos, layout, spec)
    done = fill(feed, [0, 1, 2, 3])
    assert done.count == 2
    assert dict(done.bad) == {
        1: f"pipeline: ValueError: cannot use {feed.sources.relpath(1)}",
        2: "pipeline: field x int32[2, 3], the batch has x int32[2, 2]",
    }
    got = rows(feed)
    assert got["x"][:2].tolist() == [[[0, 0], [0, 0]], [[3, 3], [3, 3]]] and got["indices"][:2].tolist() == [
        0,
        3,
    ]


def test_a_pipeline_that_cannot_be_imported_stops_the_worker(
    tmp_path: Path, photos: Path, open_test_feed: OpenTestFeed
) -> None:
    spec = pipeline_file(tmp_path, "raise ImportError('missing dependency: albumentations')\n")
    with pytest.raises(PipelineError, match="missing dependency: albumentations"):
        open_test_feed(photos, NUMPY_LAYOUT, spec)


def test_list_and_tar_samples_with_their_metadata(
    tmp_path: Path, open_test_feed: OpenTestFeed, caplog: pytest.LogCaptureFixture
) -> None:
    pixels = [np.full((16, 16, 3), 40 * k, np.uint8) for k in range(3)]
    (tmp_path / "imgs").mkdir()
    for k, image in enumerate(pixels):
        (tmp_path / "imgs" / f"{k}.png").write_bytes(encoded(image))
    rows_csv = "".join(f"imgs/{k}.png,{k},{k / 2},x\n" for k in range(3))
    (tmp_path / "list.csv").write_text("path,label,weight,index\n" + rows_csv)
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "train-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for k, image in enumerate(pixels):
            members = ((".png", encoded(image)), (".cls", str(k).encode()), (".weight", str(k / 2).encode()))
            for ext, data in members:
                info = tarfile.TarInfo(f"s{k}{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    spec = pipeline_file(
        tmp_path,
        """
        import numpy as np
        def fn(sample, rng):
            weight = float(sample["weight"])  # a str from a csv, bytes from a tar member
            mean = np.float32(sample["image"].mean())
            return {"mean": mean, "weight": np.float32(weight), "label": sample["label"]}
        """,
    )
    layout = SlotLayout(
        4,
        (
            FieldSpec("mean", "float32", ()),
            FieldSpec("weight", "float32", ()),
            FieldSpec("label", "int64", ()),
        ),
    )
    for source in (tmp_path / "list.csv", shards):
        feed = open_test_feed(source, layout, spec)
        with caplog.at_level(logging.WARNING):
            done = fill(feed, [2, 0, 1])
        assert (done.count, done.bad) == (3, ())
        got = rows(feed)
        assert got["mean"][:3].tolist() == [80, 0, 40] and got["weight"][:3].tolist() == [1, 0, 0.5]
        assert got["label"][:3].tolist() == [2, 0, 1]
    assert caplog.text.count("metadata 'index' is hidden") == 1  # the csv's column, once per worker


# --- independence from the worker and the order -----------------------------------------------------

DRAWS = """
import random
import numpy as np
import torch
def fn(sample, rng):
    crop = sample["image"][: 8 + int(rng.integers(8)), :16]
    noise = np.float32(random.random() + np.random.rand() + torch.rand(()).item())
    return {"thumb": np.ascontiguousarray(crop[:8, :8]), "noise": noise, "draw": rng.random(2)}
"""
DRAWS_LAYOUT = SlotLayout(
    8,
    (
        FieldSpec("thumb", "uint8", (8, 8, 3)),
        FieldSpec("noise", "float32", ()),
        FieldSpec("draw", "float64", (2,)),
    ),
)


def fill_in_child(
    spec: WorkerFeed, slot: int, tasks: list[list[int]], warm_up: int
) -> dict[int, list[bytes]]:
    """A worker's life: unrelated draws, then ``tasks`` one after another; each sample's field bytes."""
    for _ in range(warm_up):
        random.random(), np.random.rand(), torch.rand(1)
    feed = open_feed(spec)
    try:
        out: dict[int, list[bytes]] = {}
        for indices in tasks:
            done = fill_slot(1, feed, task(indices, slot))
            assert not done.bad, done.bad
            views = slot_views(feed.segment, spec.layout, slot, spec.slots)
            for row in range(done.count):
                out[int(views.indices[row])] = [
                    views.fields[f.name][row].tobytes() for f in spec.layout.fields
                ]
        return out
    finally:
        feed.close()


def test_a_samples_output_is_the_same_whichever_worker_and_order(tmp_path: Path, photos: Path) -> None:
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    build_index(photos).save(index_dir)
    pool = Segment.create(new_segment_name("fill-test"), DRAWS_LAYOUT.mapped_bytes(2))
    spec = worker_feed(pool.name, DRAWS_LAYOUT, index_dir, pipeline_file(tmp_path, DRAWS), "train")
    samples = [4, 50, 9, 71, 30, 2]
    backwards = samples[::-1]
    lives = [(spec, 0, [samples], 0), (spec, 1, [backwards[:2], backwards[2:]], 13)]
    try:
        with multiprocessing.get_context("spawn").Pool(2) as workers:
            first, second = workers.starmap(fill_in_child, lives)
    finally:
        pool.close()
        pool.unlink()
    assert sorted(first) == sorted(samples) and first == second
    assert len({first[i][1] for i in samples}) == len(samples)  # the draws do differ per sample
