"""End to end through the console scripts, as a user or systemd would run them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest

from loader_service.dataset.index import build_index
from tests.helpers import (
    REPO,
    ServiceFactory,
    ServiceProcess,
    console_script,
    left_behind,
    our_segments,
    plant_packages,
)

pytestmark = pytest.mark.e2e


def run(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*console_script(args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def test_index_prints_one_line_per_sample(photos: Path) -> None:
    result = run("loader-service", "index", "--data", str(photos))
    assert result.returncode == 0, result.stderr
    index = build_index(photos)
    lines = result.stdout.splitlines()
    assert len(lines) == len(index)
    for i, line in enumerate(lines):
        assert line == f"{i}\t{int(index.labels[i])}\t{index.relpath(i)}"


def test_index_of_missing_directory_fails_clearly(tmp_path: Path) -> None:
    result = run("loader-service", "index", "--data", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_serve_and_gpu_worker_run_an_epoch(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, batch_size=16, image_size=64)
    result = run("gpu-worker", "run", "--endpoint", service.endpoint, "--epochs", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    reports = re.findall(
        r"epoch (\d): (\d+) images in (\d+) batches.* ([\d.]+) images/s, data stall ([\d.]+)%", result.stdout
    )
    assert [r[0] for r in reports] == ["0", "1"]
    assert all(int(r[1]) == len(build_index(photos)) and float(r[3]) > 0 for r in reports)
    assert service.stop() == 0


@pytest.mark.parametrize("given", ["flags", "environment"])
def test_gpu_worker_run_over_a_fleet_prints_each_service_s_share(
    photos: Path, start_service: ServiceFactory, given: str
) -> None:
    one = start_service(photos, name="one", workers=1)
    two = start_service(photos, name="two", workers=1)
    if given == "flags":
        result = run(
            "gpu-worker", "run", "--endpoint", one.endpoint, "--endpoint", two.endpoint, "--device", "cpu"
        )
    else:  # no --endpoint at all: DATAFERRY_ENDPOINTS names the fleet
        fleet = {"DATAFERRY_ENDPOINTS": f"{one.endpoint},{two.endpoint}"}
        result = run("gpu-worker", "run", "--device", "cpu", env=fleet)
    assert result.returncode == 0, result.stderr
    shares = dict(re.findall(r"^  (ipc://\S+): (\d+) batches so far \(\d+%\)", result.stdout, re.MULTILINE))
    assert set(shares) == {one.endpoint, two.endpoint}
    assert sum(int(n) for n in shares.values()) == -(-len(build_index(photos)) // 8)


def test_config_file_with_flag_override(photos: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "train.toml"
    endpoint = f"ipc://{tmp_path}/cfg.sock"
    cfg.write_text(
        f'data = "{photos}"\nendpoint = "{endpoint}"\nbatch_size = 5\nimage_size = 40\nworkers = 1\n'
    )
    service = ServiceProcess(["serve", "--config", str(cfg), "--batch-size", "7"], endpoint)
    try:
        service.wait_for("ready: ")
        config_lines = [line for line in service.lines if " config: " in line]
        assert len(config_lines) == 1, "the resolved config is logged once"
        assert "batch_size=7" in config_lines[0] and "image_size=40" in config_lines[0]
        assert service.stop() == 0
    finally:
        service.kill_group()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "-1"], "workers must be at least 0"),
        (["--augment", "train", "--image-size", "3"], "image_size"),
        (["--config", "/nonexistent.toml"], "cannot read config file"),
    ],
)
def test_bad_configuration_exits_2_with_a_message(
    photos: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = run(
        "loader-service", "serve", "--data", str(photos), "--endpoint", f"ipc://{tmp_path}/x.sock", *flags
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_second_service_on_same_endpoint_is_refused(photos: Path, start_service: ServiceFactory) -> None:
    first = start_service(photos)
    second = run("loader-service", "serve", "--data", str(photos), "--endpoint", first.endpoint, timeout=60)
    assert second.returncode == 1
    assert "already listening" in second.stderr
    assert os.path.exists(first.endpoint[len("ipc://") :]), (
        "the refused service must not remove the live socket"
    )


def test_demo_trains_and_cleans_up(tmp_path: Path) -> None:
    """Run from a folder another user could write in: none of the processes the demo starts (those
    making the photos, the service, its workers' template, the trainer) imports what was planted
    there (NOTE [ Nothing from the working folder ]); before, the photo makers imported the planted
    ``multiprocessing``."""
    folder, marker = tmp_path / "shared", tmp_path / "ran"
    plant_packages(folder, marker)
    before = our_segments()
    result = run(
        "loader-service",
        "demo",
        "--dir",
        str(tmp_path / "demo"),
        "--classes",
        "2",
        "--per-class",
        "12",
        "--batch-size",
        "8",
        "--image-size",
        "64",
        timeout=300,
        cwd=folder,
    )
    assert not marker.exists(), f"a planted module ran: {marker.read_text()}"
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"images/s, data stall [\d.]+%", result.stdout)
    assert "shared memory left behind: 0 segments" in result.stdout
    assert not left_behind(before)  # other processes' segments may come and go meanwhile


def test_dry_run_prints_what_each_feeds_cache_needs_and_serves_nothing(photos: Path, tmp_path: Path) -> None:
    before = our_segments()
    config = tmp_path / "svc.toml"
    config.write_text(
        f'data = "{photos}"\nendpoint = "ipc://{tmp_path}/dry.sock"\nimage_size = 32\ncache_memory = "20M"\n'
        f'[feeds.val]\ndata = "{photos}"\naugment = "eval"\n'
    )
    result = run("loader-service", "serve", "--config", str(config), "--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The decoded size, from every header of the 90 photos, is what the cache would really take.
    index = build_index(photos)
    pixels = sum(int(np.prod(cv2.imread(str(index.path(i))).shape[:2])) for i in range(len(index)))
    decoded = re.search(r"feed train: 90 samples; decoded, about ([\d.]+) MiB", out)
    assert decoded is not None and abs(float(decoded[1]) - 3 * pixels / 2**20) < 0.1, out
    need = re.search(r"keeps decoded images: --cache-memory (\d+)M holds them all", out)
    assert need is not None and 3 * pixels < int(need[1]) * 2**20 < 3 * pixels * 1.1, out
    assert re.search(r"configured: --cache-memory 20.0 MiB, about \d+% of the samples", out), out
    row = 3 * 32 * 32 + 8
    assert "feed val: 90 samples" in out and f"keeps finished samples, {row} bytes each" in out, out
    assert "read 90/90 image headers" in result.stderr
    assert not left_behind(before)
    assert not (tmp_path / "dry.sock").exists()
