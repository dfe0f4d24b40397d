"""List and tar sources and user pipelines through a real service: what a trainer receives."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu_worker import ServiceLoader
from tests.helpers import (
    REPO,
    ServiceFactory,
    ServiceProcess,
    assert_feeds_match,
    feed_formats_without_bad_files,
    folder_samples,
    status,
    write_config,
    write_shards,
)

pytestmark = pytest.mark.integration


def test_every_source_delivers_what_the_image_folder_feed_delivers(
    photo_sources: dict[str, Path], start_service: ServiceFactory, tmp_path: Path
) -> None:
    """The same photos as a csv list, a jsonl list, a folder of shards, a brace pattern, Parquet
    files, a zip archive (stored and deflated members, in shuffled order), a ``save_to_disk``
    folder and TFRecord files, each a feed of one
    service: every epoch gives each sample once, with the ImageFolder feed's label and exactly its
    pixels (sample i is the same file in every source, so it draws the same crop)."""
    common = {"batch_size": 8, "image_size": 32, "seed": 5}
    kinds = ("csv", "jsonl", "tar", "brace", "parquet", "zip", "arrow", "tfrecord")
    feeds = {kind: {"data": photo_sources[kind], **common} for kind in kinds}
    config = write_config(tmp_path / "sources.toml", {}, feeds)
    service = start_service(photo_sources["imagefolder"], config=config, **common)
    n = len(folder_samples(photo_sources["imagefolder"]))
    reference = assert_feeds_match(service.endpoint, feeds, n, 8)
    assert reference[0] != reference[1], "epochs draw different crops"
    assert feed_formats_without_bad_files(service.endpoint) == {
        "train": "imagefolder",
        "csv": "list",
        "jsonl": "list",
        "tar": "tar",
        "brace": "tar",
        "parquet": "parquet",
        "zip": "zip",
        "arrow": "arrow",
        "tfrecord": "tfrecord",
    }


# A pipeline that uses every kind of randomness a user's code might: the rng it is given, numpy's
# legacy global generator, Python's random and torch's generator. Its output must still depend
# only on (seed, epoch, index).
FIELDS_PIPELINE = """
import json
import random

import numpy as np
import torch


def make(sample, rng):
    image = sample["image"]  # RGB HWC uint8
    top = int(rng.integers(0, image.shape[0] - 16))
    left = random.randrange(0, image.shape[1] - 16)
    crop = image[top : top + 16, left : left + 16].astype(np.float32) / 255.0
    crop += np.random.normal(0.0, 0.01, crop.shape).astype(np.float32)
    crop += float(torch.rand(()))
    meta = json.loads(sample["json"])
    return {
        "image": torch.from_numpy(crop.transpose(2, 0, 1).astype(np.float16)),
        "label": np.int64(sample["label"]),
        "where": np.array([sample["index"], sample["epoch"], len(meta["source"])], dtype=np.int32),
    }
"""


def write_pipeline(folder: Path, code: str, name: str = "pipeline_under_test.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path


def field_epoch(loader: ServiceLoader) -> dict[int, dict[str, bytes]]:
    got: dict[int, dict[str, bytes]] = {}
    for batch in loader:
        for row, idx in enumerate(batch.indices.tolist()):
            got[idx] = {name: tensor[row].numpy().tobytes() for name, tensor in batch.items()}
    return got


def test_pipeline_fields_reach_the_trainer_whatever_worker_ran_them(
    photo_sources: dict[str, Path], start_service: ServiceFactory, tmp_path: Path
) -> None:
    pipeline = write_pipeline(tmp_path, FIELDS_PIPELINE)
    samples = folder_samples(photo_sources["imagefolder"])
    runs = []
    for workers in (1, 2):
        service = start_service(
            photo_sources["tar"], pipeline=f"{pipeline}:make", workers=workers, name=f"w{workers}"
        )
        service.wait_for(r"batch fields image float16\[3, 16, 16\], label int64\[\], where int32\[3\]")
        with ServiceLoader(service.endpoint, timeout=30) as loader:
            assert loader.info.image_size == 0 and loader.info.augment == "pipeline"
            first = next(iter(loader))
            assert list(first.fields) == ["image", "label", "where"]
            images, labels, where = first  # unpacks in the pipeline's order
            assert images.dtype == torch.float16 and images.shape[1:] == (3, 16, 16)
            assert labels.dtype == torch.int64 and where.dtype == torch.int32
            assert torch.equal(where[:, 0].long(), first.indices)
            assert torch.equal(first["label"], labels)
            for row, idx in enumerate(first.indices.tolist()):
                assert int(labels[row]) == samples[idx][1]
                assert int(where[row, 2]) == len(samples[idx][0])
            del first, images, labels, where
            epochs = [field_epoch(loader) for _ in range(2)]
        assert service.stop() == 0
        assert all(sorted(e) == list(range(len(samples))) for e in epochs)
        runs.append(epochs)
    assert runs[0] == runs[1], "a sample's fields do not depend on the worker count or worker"
    assert runs[0][0] != runs[0][1], "but they do depend on the epoch"


FAILING_PIPELINE = """
import numpy as np


def make(sample, rng):
    i = sample["index"]
    if i % 7 == 3:
        raise ValueError("no good")
    size = 9 if i % 11 == 5 else 8
    return {"x": np.full((size,), i, dtype=np.int64)}
"""


def test_samples_a_pipeline_fails_on_are_skipped_counted_and_logged_once_per_error(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    pipeline = write_pipeline(tmp_path, FAILING_PIPELINE)
    service = start_service(photos, pipeline=f"{pipeline}:make")
    n = len(folder_samples(photos))
    failing = {i for i in range(n) if i % 7 == 3 or i % 11 == 5}
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        seen = []
        for batch in loader:
            assert set(batch.fields) == {"x"}
            assert torch.equal(batch["x"][:, 0], batch.indices)
            seen += batch.indices.tolist()
    assert sorted(seen) == sorted(set(range(n)) - failing)
    body = status(service.endpoint)
    # Counted per decode: the next epoch's first batches, decoded ahead, may add to it.
    assert body["feeds"][0]["bad_files"] >= len(failing)
    # The log arrives through a pipe: on a busy machine it may trail the batches.
    service.wait_for(r"bad sample skipped.*no good")
    service.wait_for(r"bad sample skipped.*int64\[8\]")
    raised = [line for line in service.lines if "bad sample skipped" in line and "no good" in line]
    mismatched = [
        line for line in service.lines if "bad sample skipped" in line and "x" in line and "9" in line
    ]
    assert len(raised) == 1, "one line per distinct error, not one per sample"
    assert "ValueError" in raised[0]
    assert len(mismatched) == 1 and "int64[8]" in mismatched[0], mismatched


@pytest.mark.parametrize(
    ("code", "target", "expected"),
    [
        ("def make(sample, rng):\n    return {", "make", "SyntaxError"),
        ("import no_such_module_anywhere\n", "make", "ModuleNotFoundError"),
        ("def other(sample, rng):\n    return {}\n", "make", "make"),
        (
            "def make(sample, rng):\n    raise RuntimeError('sample zero is bad')\n",
            "make",
            "sample zero is bad",
        ),
        ("def make(sample, rng):\n    return [1, 2]\n", "make", "dict"),
        (
            "import numpy as np\ndef make(sample, rng):\n    return {'c': np.zeros(2, np.complex64)}\n",
            "make",
            "complex64",
        ),
        (
            "import numpy as np\n"
            "def make(sample, rng):\n    return {f'f{i}': np.int8(i) for i in range(40)}\n",
            "make",
            "fields",
        ),
    ],
)
def test_a_pipeline_that_cannot_run_stops_the_start_with_exit_2(
    photos: Path, tmp_path: Path, code: str, target: str, expected: str
) -> None:
    pipeline = write_pipeline(tmp_path, code)
    endpoint = f"ipc://{tmp_path}/bad.sock"
    service = ServiceProcess(
        ["serve", "--data", str(photos), "--endpoint", endpoint, "--pipeline", f"{pipeline}:{target}"],
        endpoint,
    )
    try:
        assert service.proc.wait(60) == 2, service.log
    finally:
        service.kill_group()
    assert "cannot start" in service.log and expected in service.log, service.log


def test_stated_fields_that_differ_from_the_pipeline_stop_the_start(photos: Path, tmp_path: Path) -> None:
    pipeline = write_pipeline(tmp_path, FAILING_PIPELINE)
    config = tmp_path / "stated.toml"
    config.write_text(f'pipeline = "{pipeline}:make"\n[fields]\nx = {{ dtype = "int32", shape = [8] }}\n')
    endpoint = f"ipc://{tmp_path}/stated.sock"
    service = ServiceProcess(
        ["serve", "--data", str(photos), "--endpoint", endpoint, "--config", str(config)], endpoint
    )
    try:
        assert service.proc.wait(60) == 2, service.log
    finally:
        service.kill_group()
    assert re.search(
        r"returns x int64\[8\] for sample 0, but the config file states x int32\[8\]", service.log
    )


def test_a_damaged_tar_member_makes_only_its_sample_bad(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    shards = write_shards(photos, tmp_path / "damaged", per_shard=32)
    n = len(folder_samples(photos))
    # Spoil one image's bytes in the first shard, and cut the last shard inside its last image.
    first = bytearray(shards[0].read_bytes())
    at = first.index(b"\xff\xd8\xff", first.index(b"sample000005.jpg"))
    first[at : at + 64] = b"\0" * 64
    shards[0].write_bytes(bytes(first))
    last = shards[-1].read_bytes()
    last_key = f"sample{n - 1:06d}"
    cut = last.index(b"\xff\xd8\xff", last.index(f"{last_key}.jpg".encode())) + 1000
    shards[-1].write_bytes(last[:cut])
    service = start_service(tmp_path / "damaged", batch_size=8)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        seen = sorted(i for batch in loader for i in batch.indices.tolist())
    assert seen == sorted(set(range(n)) - {5, n - 1})
    feed = status(service.endpoint)["feeds"][0]
    assert feed["bad_files"] >= 2  # a sample the warm start also decoded counts twice
    assert set(feed["recent_bad_files"]) == {
        f"{shards[0].name}:sample000005",
        f"{shards[-1].name}:{last_key}",
    }


def test_index_command_names_tar_samples_by_shard_and_key(photo_sources: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loader_service", "index", "--data", str(photo_sources["tar"])],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    samples = folder_samples(photo_sources["imagefolder"])
    assert len(lines) == len(samples)
    assert lines[17] == f"17\t{samples[17][1]}\ttrain-000001.tar:sample000017"


HANGING_PIPELINE = """
import time

import numpy as np


def make(sample, rng):
    if sample["index"] == HANG_ON:
        while True:  # a pipeline stuck for good: only the service's kill ends it
            time.sleep(1)
    return {"x": np.int64(sample["index"])}
"""


def test_a_pipeline_that_hangs_is_ended_by_the_task_timeout(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    hang_on = 13
    pipeline = write_pipeline(tmp_path, HANGING_PIPELINE.replace("HANG_ON", str(hang_on)))
    service = start_service(photos, pipeline=f"{pipeline}:make", batch_size=4, task_timeout=2)
    with ServiceLoader(service.endpoint, timeout=120) as loader:
        seen = [i for batch in loader for i in batch["x"].tolist()]
    n = len(folder_samples(photos))
    assert sorted(seen) == sorted(set(range(n)) - {hang_on}), "only the sample that hung is lost"
    service.wait_for(r"its decode worker finished nothing for over 2 s")


WIDE_PIPELINE = """
import numpy as np


def make(sample, rng):
    i = sample["index"]
    return {
        "small": np.int16(i),
        "big": np.full((3, 64, 64), i % 251, dtype=np.uint8),  # 12 KiB a sample: zero-copy over TCP
        "noise": rng.random((64, 64), dtype=np.float32),  # 16 KiB
    }
"""
ONE_FIELD_PIPELINE = """
import numpy as np


def make(sample, rng):
    return {"x": np.array([sample["index"], sample["label"]], dtype=np.int64)}
"""


@pytest.mark.parametrize("code", [WIDE_PIPELINE, ONE_FIELD_PIPELINE], ids=["three-fields", "one-field"])
def test_remote_trainers_get_every_field_of_a_pipeline_feed(
    photos: Path, start_service: ServiceFactory, tmp_path: Path, code: str
) -> None:
    """Over TCP each field is its own frame: the fields a remote trainer receives are the bytes a
    local one maps."""
    pipeline = write_pipeline(tmp_path, code)
    service = start_service(photos, pipeline=f"{pipeline}:make", batch_size=8)
    received = {}
    for transport in ("tcp", "shm"):
        with ServiceLoader(service.endpoint, transport=transport, timeout=30) as loader:
            assert loader.transport == transport
            received[transport] = field_epoch(loader)
    assert received["tcp"] == received["shm"]
    assert sorted(received["tcp"]) == list(range(len(folder_samples(photos))))
    assert status(service.endpoint)["remote_send_bytes"] == 0


def test_the_albumentations_example_gives_the_same_pixels_whatever_worker_ran_it(
    photos: Path, start_service: ServiceFactory
) -> None:
    pytest.importorskip("albumentations", reason="albumentations is a test dependency (dev extra)")
    example = REPO / "examples" / "pipelines" / "albumentations_aug.py"
    runs = []
    for workers in (1, 2):
        service = start_service(photos, pipeline=f"{example}:train", workers=workers, name=f"w{workers}")
        with ServiceLoader(service.endpoint, timeout=60) as loader:
            assert [f[0] for f in loader.info.fields] == ["image", "label"]
            runs.append(field_epoch(loader))
        assert service.stop() == 0
        assert "differ" not in service.log, "the start-up run found sample 0 non-deterministic"
    assert runs[0] == runs[1]
    assert len(runs[0]) == len(folder_samples(photos))
