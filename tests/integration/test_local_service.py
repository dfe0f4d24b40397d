"""``ServiceLoader.local``: a private service for one trainer, started with the loader and gone with
it, whether the loader closes or the trainer is SIGKILLed (NOTE [ Stop with stdin ])."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceError, ServiceLoader
from gpu_worker.local import serve_flags
from loader_service.shm import remove_stale
from loader_service.tools.sample_data import make_sample_dataset
from tests.helpers import REPO, ServiceFactory, epoch_indices, our_segments, plant_packages

TRAINER = """
import sys, time
from gpu_worker import ServiceLoader
loader = ServiceLoader.local(sys.argv[1], workers=1, batch_size=8, image_size=32, log_level="WARNING")
batch = next(iter(loader))
print(loader._private.process.pid, loader._private.endpoint, len(batch.indices), flush=True)
sys.stdin.read()  # until the test kills this process
"""


def wait_gone(pid: int, timeout: float) -> bool:
    """Until process ``pid`` has exited (its pidfd becomes readable), at most ``timeout`` s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def socket_path(endpoint: str) -> Path:
    return Path(endpoint[len("ipc://") :])


def test_a_private_service_serves_an_epoch_and_stops_with_the_loader(photos: Path) -> None:
    with ServiceLoader.local(photos, workers=1, batch_size=8, image_size=32) as loader:
        private = loader._private
        assert private is not None and socket_path(private.endpoint).exists()
        seen, _ = epoch_indices(loader)
        assert sorted(seen) == list(range(90)), "every image once"
    assert private.process.returncode == 0, "stopped cleanly by the end of its stdin"
    assert not socket_path(private.endpoint).exists()


def test_a_sigkilled_trainer_leaves_no_service_and_no_shared_memory(photos: Path) -> None:
    command = [sys.executable, "-c", TRAINER, str(photos)]
    with subprocess.Popen(
        command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as trainer:
        try:
            assert trainer.stdout is not None
            pid, endpoint, rows = trainer.stdout.readline().split()
            assert int(rows) == 8
            assert any(name.startswith(f"dataferry-{pid}-") for name in our_segments()), "its slots exist"
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
            assert wait_gone(int(pid), 30), "the private service outlived its trainer"
        finally:
            trainer.kill()
            if "pid" in locals() and not wait_gone(int(pid), 0):
                os.kill(int(pid), signal.SIGTERM)  # a failed test leaves nothing behind either
    assert not [name for name in our_segments() if name.startswith(f"dataferry-{pid}-")]
    assert not socket_path(endpoint).exists()
    folder = socket_path(endpoint).parent  # NOTE [ A private service ]: the next start removes it
    # Removed here, or by a start of another test running beside this one: any start removes it.
    remove_stale((Path(tempfile.gettempdir()),))
    assert not folder.exists()


def test_options_the_service_refuses_fail_the_call_at_once(photos: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ServiceError, match="exited with code 2 before it was ready"):
        ServiceLoader.local(photos, batch_size=-3)
    assert time.monotonic() - start < 30, "not after the start timeout"


def test_with_dataferry_endpoints_set_it_attaches_to_the_shared_service(
    photos: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = start_service(photos)
    monkeypatch.setenv("DATAFERRY_ENDPOINTS", shared.endpoint)
    monkeypatch.chdir(photos.parent)  # the same data, named from elsewhere
    with ServiceLoader.local(photos.name, batch_size=8) as loader:
        assert loader._private is None
        seen, _ = epoch_indices(loader)
    assert sorted(seen) == list(range(90))


def test_a_shared_service_serving_other_batches_fails_the_attach_naming_both(
    photos: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The script asks for batches of 16 at 48 px; the shared service serves 8 at 32 (before: it
    # trained on those without a word).
    shared = start_service(photos, name="shared", feed="main")
    monkeypatch.setenv("DATAFERRY_ENDPOINTS", shared.endpoint)
    with pytest.raises(
        ServiceError, match=r"serves batches of 8 samples of 32px images; this trainer asked for 16 of 48px"
    ):
        ServiceLoader.local(photos, batch_size=16, image_size=48, feed="main")
    with pytest.raises(ServiceError, match="main"):  # the feed is the one named, not the first
        ServiceLoader.local(photos, batch_size=8, feed="other")
    with ServiceLoader.local(photos, batch_size=8, image_size=32, feed="main") as loader:
        assert (loader.info.name, loader.info.batch_size) == ("main", 8)


def test_a_shared_service_on_other_data_or_another_seed_or_transform_fails_the_attach(
    photos: Path, tmp_path: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same geometry is not the same feed. Before the fix each call below attached and trained
    on what the shared service served; now the call fails before any batch, naming each difference.
    Options the call does not give are the shared service's business."""
    shared = start_service(photos, seed=1, augment="eval", interpolation="area")
    monkeypatch.setenv("DATAFERRY_ENDPOINTS", shared.endpoint)
    other = tmp_path / "other"
    make_sample_dataset(other, classes=2, per_class=4, seed=3)
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"data": other}, re.escape(f"data '{other}' (it serves '{photos}')")),
        ({"seed": 2}, re.escape("seed 2 (it serves 1)")),
        ({"augment": "train"}, re.escape("augment 'train' (it serves 'eval')")),
        ({"interpolation": "bilinear"}, re.escape("interpolation 'bilinear' (it serves 'area')")),
        (
            {"pipeline": f"{tmp_path / 'aug.py'}:make"},
            re.escape(f"pipeline '{tmp_path / 'aug.py'}:make' (it"),
        ),
    ]
    for asked, named in refusals:
        options: dict[str, Any] = {"data": photos, "batch_size": 8, "image_size": 32, **asked}
        with pytest.raises(ServiceError, match=named):
            ServiceLoader.local(**options).close()
    with pytest.raises(ServiceError, match=r"seed 2 .*; augment 'none' .*; interpolation 'bilinear'"):
        ServiceLoader.local(photos, seed=2, augment="none", interpolation="bilinear").close()
    with ServiceLoader.local(photos, batch_size=8, image_size=32, seed=1, augment="eval") as loader:
        assert loader._private is None and (loader.info.seed, loader.info.augment) == (1, "eval")
        seen, _ = epoch_indices(loader)
    assert sorted(seen) == list(range(90)), "the same feed, asked for as it is: attached"


# Packages another user left in the trainer's working folder (tests.helpers.plant_packages).
PLANTED_TRAINER = """
import json, sys
from gpu_worker import ServiceLoader
data, pipeline = sys.argv[1], sys.argv[2]
options = {"pipeline": pipeline} if pipeline else {"image_size": 32}
with ServiceLoader.local(data, workers=1, batch_size=8, timeout=60, **options) as loader:
    seen, spread = [], 0.0
    for batch in loader:
        seen += batch.indices.tolist()
        spread = max(spread, float(batch["image"].float().std()))
print(json.dumps({"seen": sorted(seen), "spread": spread}), flush=True)
"""
CROP_PIPELINE = """
import numpy as np


def crop(sample, rng):
    return {"image": np.ascontiguousarray(sample["image"][:8, :8].transpose(2, 0, 1)), "label": np.int64(0)}
"""


@pytest.mark.parametrize("transform", ["built-in", "pipeline"])
def test_a_package_planted_in_the_trainers_folder_never_runs(
    photos: Path, tmp_path: Path, transform: str
) -> None:
    """The trainer runs from a folder someone else could write in; the private service, its
    pipeline probe and its workers' template import nothing from there, and serve the real data.
    Before the fix the service was ``python -m loader_service`` in that folder: the planted
    package ran as the trainer and the loader failed (here) or served what it chose (the review)."""
    folder, marker = tmp_path / "shared", tmp_path / "ran"
    plant_packages(folder, marker)
    script = tmp_path / "script" / "train.py"  # its own folder: the trainer itself is not the test
    script.parent.mkdir()
    script.write_text(PLANTED_TRAINER)
    pipeline = ""
    if transform == "pipeline":
        (tmp_path / "crop.py").write_text(CROP_PIPELINE)
        pipeline = f"{tmp_path / 'crop.py'}:crop"
    run = subprocess.run(
        [sys.executable, str(script), str(photos), pipeline],
        check=False,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert not marker.exists(), f"a planted module ran: {marker.read_text()}"
    assert run.returncode == 0, run.stderr[-3000:]
    received = json.loads(run.stdout.splitlines()[-1])
    assert received["seen"] == list(range(90)), "the real service's epoch, every image once"
    assert received["spread"] > 10, "real photos, not a uniform image"


def test_keyword_options_become_serve_flags() -> None:
    flags = serve_flags(
        {"batch_size": 64, "strict": True, "insecure_tcp": False, "seed": None, "data_dir": Path("/d")}
    )
    assert flags == ["--batch-size", "64", "--strict", "--no-insecure-tcp", "--data-dir", "/d"]
    with pytest.raises(TypeError, match="serve option fields"):
        serve_flags({"fields": ["a"]})
