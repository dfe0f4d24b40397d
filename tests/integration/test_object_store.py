"""Data in an object store, through a real S3 server (SeaweedFS on loopback, testkit/s3server.py):
the same feed as from a local copy, and what happens when the store fails for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.formats.perfile import SampleFiles
from loader_service.dataset.index import build_index
from loader_service.dataset.storage import objectfiles as remotefiles
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.objectstore import Bucket
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import StorageError
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import SampleReader
from protocol.pixels import DecodeError
from testkit.counting import counted_store_reads
from testkit.netfaults import FaultProxy
from tests.helpers import (
    REPO,
    ServiceFactory,
    ServiceProcess,
    assert_feeds_match,
    feed_formats_without_bad_files,
    folder_samples,
    in_background,
    receive_epoch,
    status,
    write_config,
)

if TYPE_CHECKING:
    from testkit.s3server import S3Server

pytestmark = pytest.mark.integration


def test_shards_lists_and_parquet_in_a_store_deliver_what_the_local_copies_deliver(
    s3_server: S3Server,
    s3_sources: dict[str, str],
    photo_sources: dict[str, Path],
    start_service: ServiceFactory,
    tmp_path: Path,
) -> None:
    """Tar shards by prefix and by pattern, a csv list of image objects, Parquet files, a zip
    archive (read by range), a save_to_disk folder and TFRecord files, each a feed beside the local
    shards: every epoch gives each sample once, with the local feed's label and pixels."""
    common = {"batch_size": 8, "image_size": 32, "seed": 5}
    feeds = {f"s3{kind}": {"data": url, **common} for kind, url in s3_sources.items()}
    config = write_config(tmp_path / "s3.toml", {}, feeds)
    service = start_service(photo_sources["tar"], config=config, env=s3_server.env(), **common)
    assert_feeds_match(service.endpoint, feeds, len(folder_samples(photo_sources["imagefolder"])), 8)
    assert feed_formats_without_bad_files(service.endpoint) == {
        "train": "tar",
        "s3tar": "tar",
        "s3brace": "tar",
        "s3csv": "list",
        "s3parquet": "parquet",
        "s3zip": "zip",
        "s3arrow": "arrow",
        "s3tfrecord": "tfrecord",
    }


def test_the_fingerprint_does_not_depend_on_where_the_shards_are(
    s3_server: S3Server,
    s3_sources: dict[str, str],
    photo_sources: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint taken on the local copy resumes on the store's, and back."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    local = build_index(photo_sources["tar"]).fingerprint()
    assert (
        build_index(s3_sources["tar"]).fingerprint()
        == build_index(s3_sources["brace"]).fingerprint()
        == local
    )


def test_a_wrong_secret_stops_the_start_with_exit_2_naming_the_bucket(
    s3_server: S3Server, s3_sources: dict[str, str], tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/denied.sock"
    wrong = "not-the-secret-0123456789"
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": wrong}
    service = ServiceProcess(
        ["serve", "--data", s3_sources["tar"], "--endpoint", endpoint], endpoint, env=env
    )
    try:
        assert service.proc.wait(60) == 2
    finally:
        service.kill_group()
    assert f"cannot start: s3://{s3_server.bucket}: access denied" in service.log
    assert "Traceback" not in service.log and wrong not in service.log


def test_storage_options_reach_the_store_and_are_never_logged(
    s3_server: S3Server, s3_sources: dict[str, str], photos: Path, start_service: ServiceFactory
) -> None:
    """The endpoint, the credentials and plain http given as --storage-option, none in the
    environment: the store (and the client, for allow_http) get them, the log names only keys."""
    service = start_service(
        s3_sources["tar"],
        storage_option=[
            f"endpoint={s3_server.endpoint}",
            f"access_key_id={s3_server.access_key}",
            f"secret_access_key={s3_server.secret_key}",
            f"region={s3_server.env()['AWS_REGION']}",
            "allow_http=true",
        ],
    )
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        assert sorted(receive_epoch(loader)) == list(range(len(folder_samples(photos))))
    assert s3_server.secret_key not in service.log
    assert "secret_access_key=***" in service.log


def test_the_store_killed_and_restarted_mid_epoch_loses_no_sample(
    fresh_s3_server: S3Server, photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """The store is down longer than the workers' read deadline (half of --task-timeout 4): their
    tasks come back undone and wait, and once the store is back the epoch ends with every sample
    exactly once and none reported bad."""
    fresh_s3_server.upload_tree(photo_sources["tar"], "shards")
    n = len(folder_samples(photo_sources["imagefolder"]))
    service = start_service(
        f"s3://{fresh_s3_server.bucket}/shards/",
        env=fresh_s3_server.env(),
        batch_size=4,
        slots=3,
        task_timeout=4,
    )

    outage: Future[None] = Future()

    def one_epoch() -> list[int]:
        seen: list[int] = []
        with ServiceLoader(service.endpoint, timeout=60) as loader:
            for k, batch in enumerate(loader):
                if k == 2:
                    fresh_s3_server.kill()
                    outage.set_result(None)
                seen += batch.indices.tolist()
        return seen

    with in_background(one_epoch, "an epoch across the outage") as epoch:
        outage.result(60)
        # Logged when a worker hands its task back: the store was down longer than its deadline.
        service.wait_for(r"the data's store does not answer", 30)
        fresh_s3_server.restart()
        got = epoch.result(90)
    assert sorted(got) == list(range(n)), "every sample exactly once across the outage"
    feed = status(service.endpoint)["feeds"][0]
    assert feed["bad_files"] == 0 and feed["store_waits"] > 0, "the silences counted, nothing lost"


def test_an_object_deleted_mid_epoch_is_one_bad_sample_named_by_its_url(
    fresh_s3_server: S3Server, photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    fresh_s3_server.upload_tree(photos, "set/photos")
    samples = folder_samples(photos)
    listed = tmp_path / "train.csv"
    listed.write_text("path,label\n" + "".join(f"photos/{rel},{label}\n" for rel, label in samples))
    fresh_s3_server.upload(listed, "set/train.csv")
    service = start_service(
        f"s3://{fresh_s3_server.bucket}/set/train.csv", env=fresh_s3_server.env(), batch_size=4, slots=3
    )
    gone = len(samples) - 1  # the last sample: the epoch is well under way before any worker reads it
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        seen: list[int] = []
        for k, batch in enumerate(loader):
            if k == 0:
                fresh_s3_server.delete(f"set/photos/{samples[gone][0]}")
            seen += batch.indices.tolist()
    assert sorted(seen) == [i for i in range(len(samples)) if i != gone]
    feed = status(service.endpoint)["feeds"][0]
    assert feed["bad_files"] == 1
    url = f"s3://{fresh_s3_server.bucket}/set/photos/{samples[gone][0]}"
    service.wait_for(rf"{url}: not found", 10)


def test_a_cache_folder_serves_an_epoch_with_the_store_down_and_a_restart_without_indexing(
    fresh_s3_server: S3Server, photo_sources: dict[str, Path], start_service: ServiceFactory, tmp_path: Path
) -> None:
    """The start fetches each shard once to index it and keeps it (NOTE [ Fetch cache ]): a whole epoch
    then needs no store at all. The next start finds the saved index current and scans nothing; a shard
    replaced in the store makes the one after index again (NOTE [ Saved indexes ])."""
    fresh_s3_server.upload_tree(photo_sources["tar"], "shards")
    data = f"s3://{fresh_s3_server.bucket}/shards/"
    n = len(folder_samples(photo_sources["imagefolder"]))
    cache = {"cache_dir": tmp_path / "cache", "cache_size": "1G"}
    first = start_service(data, name="first", env=fresh_s3_server.env(), **cache)
    kept = list((tmp_path / "cache" / "objects").rglob("*"))
    assert sum(p.is_file() for p in kept) == len(list(photo_sources["tar"].iterdir())), "every shard kept"
    fresh_s3_server.stop()
    with ServiceLoader(first.endpoint, timeout=30) as loader:
        assert sorted(receive_epoch(loader)) == list(range(n)), "an epoch read from the cache folder alone"
    assert status(first.endpoint)["feeds"][0]["bad_files"] == 0
    assert first.stop() == 0
    fresh_s3_server.restart()
    second = start_service(data, name="second", env=fresh_s3_server.env(), **cache)
    second.wait_for(r"the saved index of \d+ samples is current", 1)
    assert second.stop() == 0
    shards = sorted(photo_sources["tar"].iterdir())
    fresh_s3_server.upload(shards[1], f"shards/{shards[0].name}")  # another object under that name
    third = start_service(data, name="third", env=fresh_s3_server.env(), **cache)
    assert "is current" not in third.log
    with ServiceLoader(third.endpoint, timeout=30) as loader:
        assert len(receive_epoch(loader)) == n, "indexed anew: the replaced shard's samples are read"


def test_the_index_command_reads_a_store_with_storage_options(
    s3_server: S3Server, s3_sources: dict[str, str], photos: Path
) -> None:
    """``loader-service index`` through the CLI, the credentials given as options, not in the environment."""
    options = [
        f"endpoint={s3_server.endpoint}",
        f"access_key_id={s3_server.access_key}",
        f"secret_access_key={s3_server.secret_key}",
        "allow_http=true",
    ]
    argv = [sys.executable, "-m", "loader_service", "index", "--data", s3_sources["parquet"]]
    for option in options:
        argv += ["--storage-option", option]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def index(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, check=False, capture_output=True, text=True, timeout=60, env=env, cwd=REPO
        )

    done = index(*argv)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    samples = folder_samples(photos)
    assert len(lines) == len(samples)
    assert lines[0] == f"0\t{samples[0][1]}\ttrain-00000-of-00002.parquet:0"
    bad = index(*[a.replace(s3_server.secret_key, "wrong") for a in argv])
    assert bad.returncode == 2 and "access denied" in bad.stderr and "Traceback" not in bad.stderr
    plain = index(*argv[:-2])  # without its last option, allow_http=true
    assert plain.returncode == 2 and "allow_http" in plain.stderr, "a plain-http endpoint says what it needs"


def test_a_shard_replaced_after_indexing_is_never_read_as_the_indexed_one(
    s3_server: S3Server, photo_sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ranged read names the ETag the index saw: a shard overwritten with other bytes gives its
    samples as bad, named by URL, instead of bytes from wherever the offsets now point."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    shards = sorted(photo_sources["tar"].iterdir())
    s3_server.upload_tree(photo_sources["tar"], "replaced")
    index = build_index(f"s3://{s3_server.bucket}/replaced/")
    reader = SampleReader(index, 1 << 28, StorageConfig())
    s3_server.upload(shards[1], f"replaced/{shards[0].name}")
    reader.prefetch([0, 16])
    with pytest.raises(
        DecodeError, match=rf"s3://{s3_server.bucket}/replaced/{shards[0].name}: changed since"
    ):
        reader.image_bytes(0)
    assert reader.image_bytes(16) == SampleReader(build_index(photo_sources["tar"]), 1 << 28).image_bytes(16)
    reader.close()


def test_a_readers_store_answers_reach_whoever_it_was_given_and_nobody_else(
    s3_server: S3Server, photo_sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Waiting on the store ]: a decode worker's progress page hears of every answer of the
    store to its reader's reads (the headers, then the bytes), through the reader it built; a second
    reader in the same process, given no listener, tells it nothing."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    s3_server.upload_tree(photo_sources["tar"], "heard")
    index = build_index(f"s3://{s3_server.bucket}/heard/")
    answers: list[int] = []
    listened = SampleReader(index, 1 << 28, StorageConfig(), heard=lambda: answers.append(1))
    silent = SampleReader(index, 1 << 28, StorageConfig())
    try:
        assert silent.image_bytes(3) and answers == []
        assert listened.image_bytes(3) == silent.image_bytes(3)
        assert len(answers) >= 2, "the answer's headers and its bytes"
        before = len(answers)
        silent.image_bytes(5)
        assert len(answers) == before
    finally:
        listened.close()
        silent.close()


def test_a_format_that_cannot_read_a_store_says_so_for_a_store_url(s3_server: S3Server) -> None:
    """NOTE [ One location ]: --format imagefolder with an s3:// URL is refused by name, not taken
    for a local path that does not exist."""
    with pytest.raises(DatasetError, match="imagefolder cannot be read from an object store"):
        build_index(f"s3://{s3_server.bucket}/anything/", "imagefolder")


def test_an_object_over_max_file_bytes_is_refused_having_read_little_of_it(
    s3_server: S3Server, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listed object's size is its writer's to choose: a worker stops reading it past the limit."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    big = tmp_path / "big.jpg"
    big.write_bytes(os.urandom(20 << 20))
    rel = folder_samples(photos)[0][0]
    s3_server.upload(big, "big/big.jpg")
    s3_server.upload(photos / rel, "big/small.jpg")
    listed = tmp_path / "train.csv"
    listed.write_text("path\nbig.jpg\nsmall.jpg\n")
    s3_server.upload(listed, "big/train.csv")
    reader = SampleReader(build_index(f"s3://{s3_server.bucket}/big/train.csv"), 1 << 20, StorageConfig())
    with counted_store_reads() as fetched:
        reader.prefetch([0, 1])
    with pytest.raises(DecodeError, match="over --max-file-bytes"):
        reader.image_bytes(0)
    assert reader.image_bytes(1) == (photos / rel).read_bytes()
    assert max(fetched) < 2 << 20, f"read {max(fetched)} bytes of a 20 MiB object to refuse it"
    reader.close()


def test_a_key_the_store_refuses_costs_its_sample_only(
    s3_server: S3Server, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list row obstore cannot even ask for (``./x.jpg``) is a bad sample, not a store that is
    down: the other samples of its batch read at once."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    rel = folder_samples(photos)[0][0]
    s3_server.upload(photos / rel, "dots/small.jpg")
    listed = tmp_path / "train.csv"
    listed.write_text("path\n./small.jpg\nsmall.jpg\n")
    s3_server.upload(listed, "dots/train.csv")
    reader = SampleReader(build_index(f"s3://{s3_server.bucket}/dots/train.csv"), 1 << 20, StorageConfig())
    started = time.monotonic()
    reader.prefetch([0, 1])
    with pytest.raises(DecodeError, match=r"dots/\./small\.jpg"):
        reader.image_bytes(0)
    assert reader.image_bytes(1) == (photos / rel).read_bytes()
    assert time.monotonic() - started < 5, "refused at once, not retried until the deadline"
    reader.close()


def test_a_slow_store_delays_parquet_batches_and_loses_none(
    s3_server: S3Server,
    s3_sources: dict[str, str],
    photo_sources: dict[str, Path],
    start_service: ServiceFactory,
) -> None:
    """Every request to the store takes about 0.3 s (the fault proxy holds each chunk 0.15 s each
    way) and --task-timeout is 2 s, so a worker's read deadline is 1 s: one request always answers in
    time, but a Parquet sample whose page map is new needs several in a row, longer in all than the
    task timeout. A worker waiting on a store that answers is not a hung decoder: the epoch gives
    every sample once, no worker is killed and none is reported bad."""
    n = len(folder_samples(photo_sources["imagefolder"]))
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.faults.latency = 0.15
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
        service = start_service(s3_sources["parquet"], env=env, batch_size=16, task_timeout=2)
        with ServiceLoader(service.endpoint, timeout=120) as loader:
            got = receive_epoch(loader)
        feed = status(service.endpoint)["feeds"][0]
    assert sorted(got) == list(range(n)), f"{n - len(got)} of {n} samples lost"
    assert feed["bad_files"] == 0
    assert "killing it" not in service.log


def test_a_store_sending_more_than_it_listed_fills_no_disk(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing says 1,000 bytes; the store sends the whole 3 MiB object, under the same ETag (as
    a store that lies would). The fetch stops at the listed size: no more than that reaches the
    disk, and the start fails naming the object."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    (tmp_path / "big.tar").write_bytes(os.urandom(3 << 20))
    s3_server.upload(tmp_path / "big.tar", "oversend/big.tar")
    bucket = Bucket(f"s3://{s3_server.bucket}", StorageConfig(), 30.0)
    (listed,) = bucket.list("oversend/")
    assert listed.size == 3 << 20
    dest = tmp_path / "copy"
    with pytest.raises(StorageError, match="sent more than the 1000 bytes it listed"):
        bucket.download(replace(listed, size=1000), dest)
    assert dest.stat().st_size == 1000
    bucket.download(listed, tmp_path / "whole")
    assert (tmp_path / "whole").read_bytes() == (tmp_path / "big.tar").read_bytes()


def test_a_worker_holds_at_most_its_prefetch_budget_of_a_tasks_bytes(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Prefetch budget ]: twenty 1 MiB objects a task reads, with a 4 MiB budget. Where the
    index knows their sizes (tar members, Parquet pages, listed shards) the reads go out in windows
    as the task reaches them and at most the budget (and one object) is held at once; each object
    is read once and whole, in order, and a task that skips some (cached samples) still gets the
    rest. Where it does not (a list's objects), the same holds: a fresh worker's first window asks
    for eight objects and holds the four that fit, and later ones follow the mean size it saw."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    budget, size = 4 << 20, 1 << 20
    monkeypatch.setattr(remotefiles, "PREFETCH_BYTES", budget)
    monkeypatch.setattr(remotefiles, "FIRST_GUESS", budget // 8)
    blobs = {f"budget/{k:02d}.bin": os.urandom(size) for k in range(20)}
    for key, blob in blobs.items():
        (tmp_path / "blob").write_bytes(blob)
        s3_server.upload(tmp_path / "blob", key)
    bucket = Bucket(f"s3://{s3_server.bucket}", StorageConfig(), 30.0)
    versions = {o.key: (o.size, o.etag) for o in bucket.list("budget/")}
    keys = list(blobs)
    for known in (versions, {}):
        files = remotefiles.ObjectFiles(f"s3://{s3_server.bucket}", StorageConfig(), known, 8 << 20)
        try:
            with counted_store_reads() as reads:
                files.prefetch([(key, 0, -1) for key in keys])
                held = [files.held_bytes()]
                for key in keys:
                    assert files.read(key, 8 << 20) == blobs[key]
                    held.append(files.held_bytes())
                assert len(reads) == len(blobs), "each object fetched once"
                assert max(held) <= budget, f"held up to {max(held) / 2**20:.0f} MiB"
                assert held[0] == budget, "the first window holds what fits"
                reads.clear()
                files.prefetch([(key, 0, -1) for key in keys])
                for key in keys[10:]:  # the first ten came from a cache: never read
                    assert files.read(key, 8 << 20) == blobs[key]
                assert len(reads) == len(blobs) - 10 + budget // size, "the first window, then what is read"
        finally:
            files.close()


def test_a_task_of_large_objects_after_small_ones_holds_at_most_the_budget(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, as found: a list's objects have no size in the index. A task of 32 objects of
    64 KiB, then one of 32 objects of 8 MiB, through a list format's reader with the real 64 MiB
    budget: the mean of the small ones once let the whole second task (256 MiB) be held at once.
    NOTE [ Prefetch budget ]: a read holds its bytes only if the size its answer states fits, so
    the worker holds at most the budget (and one object), reads each object whole once, and every
    sample arrives."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    small, large = tmp_path / "small.jpg", tmp_path / "large.jpg"
    small.write_bytes(os.urandom(64 << 10))
    large.write_bytes(os.urandom(8 << 20))
    names = [f"small-{k:02d}.jpg" for k in range(32)] + [f"large-{k:02d}.jpg" for k in range(32)]
    for name in names:
        s3_server.upload(small if name.startswith("small") else large, f"issue35/{name}")
    (tmp_path / "train.csv").write_text("path\n" + "\n".join(names) + "\n")
    s3_server.upload(tmp_path / "train.csv", "issue35/train.csv")
    index = build_index(f"s3://{s3_server.bucket}/issue35/train.csv")
    files = open_files(index, StorageConfig(), 16 << 20)
    reader = SampleFiles(files, index.names, 16 << 20)
    peaks: list[int] = []
    try:
        with counted_store_reads() as bodies:
            for task, blob in ((range(32), small.read_bytes()), (range(32, 64), large.read_bytes())):
                reader.prefetch(list(task))
                held = [files.held_bytes()]
                for i in task:
                    assert reader.image_bytes(i) == blob
                    held.append(files.held_bytes())
                peaks.append(max(held))
    finally:
        reader.close()
    assert peaks[1] <= remotefiles.PREFETCH_BYTES + (8 << 20), f"held {peaks[1] >> 20} MiB at once"
    assert sorted(bodies) == [64 << 10] * 32 + [8 << 20] * 32, "each object's body read once"


@contextmanager
def small_disk(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options`` at ``path`` for the block (needs root), unmounted even on failure."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False)
    if mounted.returncode != 0:
        pytest.skip("needs to mount a tmpfs (root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("options", ["size=1m", "size=4m,nr_inodes=7"], ids=["no-room", "no-inodes"])
def test_a_full_cache_disk_costs_the_cache_not_the_service(
    fresh_s3_server: S3Server,
    photo_sources: dict[str, Path],
    start_service: ServiceFactory,
    tmp_path: Path,
    options: str,
) -> None:
    """The cache folder's disk (a tmpfs) cannot hold one shard (1 MiB), or not even the scan's
    folder (seven inodes: the cache folder's own entries take six): the index scan goes on in the
    system's temporary folder, keeping nothing, and says so; the service serves the epoch whole
    instead of exiting 2 (which systemd does not restart)."""
    fresh_s3_server.upload_tree(photo_sources["tar"], "shards")
    n = len(folder_samples(photo_sources["imagefolder"]))
    with small_disk(tmp_path / "small", options) as disk:
        service = start_service(
            f"s3://{fresh_s3_server.bucket}/shards/",
            env=fresh_s3_server.env(),
            cache_dir=disk / "cache",
            cache_size="10G",
        )
        assert "its disk is full" in service.log and "goes on without keeping what it fetches" in service.log
        with ServiceLoader(service.endpoint, timeout=60) as loader:
            assert sorted(receive_epoch(loader)) == list(range(n))
        assert service.stop() == 0
