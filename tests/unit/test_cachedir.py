"""The cache folder (NOTE [ Fetch cache ], NOTE [ Saved indexes ]): bounded under writers in several
processes, entries bound to an object's ETag and size, and saved indexes used only while current."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader_service.dataset.formats.tar import format as tarshards
from loader_service.dataset.index import build_index, load_or_build
from loader_service.dataset.storage.cachedir import FetchCache, index_key
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DatasetError
from tests.helpers import write_tar

URL = "s3://bucket/shards/a.tar"


def _written(cache: FetchCache, data: bytes) -> Path:
    path = cache.temp_file()
    path.write_bytes(data)
    return path


def test_entries_are_bound_to_their_etag_and_size(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "c", 1000)
    assert cache.adopt(_written(cache, b"x" * 100), URL, '"e1"', 100)
    held = cache.holds(URL, '"e1"', 100)
    assert held is not None and held.read_bytes() == b"x" * 100
    assert cache.holds(URL, '"e2"', 100) is None, "a replaced object is another entry"
    assert cache.holds(URL, '"e1"', 99) is None
    assert cache.holds(URL, "", 100) is None, "an object without an ETag is never read from the cache"
    assert not cache.adopt(_written(cache, b"y" * 10), URL, "", 10)


def test_the_folder_never_holds_more_than_its_size(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "c", 1000)
    kept = [cache.adopt(_written(cache, b"z" * 300), f"{URL}{k}", f'"{k}"', 300) for k in range(5)]
    assert kept == [True, True, True, False, False]
    assert cache.used() == 900
    assert cache.adopt(_written(cache, b"w" * 100), f"{URL}x", '"x"', 100)
    refused = _written(cache, b"w" * 100)
    assert not cache.adopt(refused, f"{URL}y", '"y"', 100) and refused.exists(), "left to its writer"
    assert cache.used() == 1000 and cache.holds(f"{URL}y", '"y"', 100) is None
    assert cache.recount() == 1000, "the counter is what the files hold"


def _reserve_many(folder: str, size: int, wanted: int, done: multiprocessing.Queue[int]) -> None:
    cache = FetchCache(folder, size)
    done.put(sum(cache.reserve(7) for _ in range(wanted)))


def test_writers_in_several_processes_share_one_bound(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    done: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_reserve_many, args=(str(tmp_path / "c"), 7000, 600, done)) for _ in range(3)]
    for p in procs:
        p.start()
    granted = sum(done.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert granted == 1000, "exactly as many 7-byte reservations as fit in 7000 bytes, over 1800 asked"
    assert FetchCache(tmp_path / "c", 7000).used() == 7000


def test_a_start_removes_what_dead_writers_left_and_nothing_of_live_ones(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "c", 1000)
    live = cache.temp_file()
    live.write_bytes(b"being written")
    dead = tmp_path / "c" / "tmp" / "999999999"
    dead.mkdir()
    (dead / "half").write_bytes(b"half an object")
    FetchCache(tmp_path / "c", 1000).recount()
    assert live.exists() and not dead.exists()


def test_a_saved_index_is_used_while_its_inputs_are_the_same(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "c", 1 << 20)
    key = index_key("tar", "/data", ["", "label"])
    assert key != index_key("tar", "/data", ["jpg", "label"]), "the columns are part of the key"
    assert cache.save_index(key, [["a.tar", 10, 1]], lambda folder: (folder / "index.json").write_text("{}"))
    assert cache.saved_index(key, [["a.tar", 10, 1]]) is not None
    assert cache.saved_index(key, [["a.tar", 10, 2]]) is None
    used = cache.used()
    assert cache.save_index(key, [["a.tar", 11, 3]], lambda folder: (folder / "index.json").write_text("{}"))
    assert cache.used() == used, "a replaced index gives its bytes back"
    small = FetchCache(tmp_path / "small", 10)
    assert not small.save_index(key, [], lambda folder: (folder / "index.json").write_text("x" * 100))
    assert small.used() == 0


def test_a_restart_maps_the_saved_index_and_a_changed_shard_scans_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shards").mkdir()
    for s in range(3):
        write_tar(tmp_path / "shards" / f"{s}.tar", [(f"k{s}.jpg", b"image"), (f"k{s}.cls", str(s).encode())])
    storage = StorageConfig(cache_dir=str(tmp_path / "c"), cache_size=1 << 30)
    first = load_or_build(tmp_path / "shards", "auto", None, storage)
    scanned = build_index(tmp_path / "shards").fingerprint()
    scans: list[int] = []
    real = tarshards.scan_files

    def counted(*args: object, **kwargs: object) -> object:
        scans.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tarshards, "scan_files", counted)
    again = load_or_build(tmp_path / "shards", "auto", None, storage)
    assert scans == [] and again.fingerprint() == first.fingerprint() == scanned
    shard = tmp_path / "shards" / "1.tar"
    write_tar(shard, [("k1.jpg", b"image"), ("k1.cls", b"7")])
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even within a clock tick
    changed = load_or_build(tmp_path / "shards", "auto", None, storage)
    assert scans == [1] and changed.labels.tolist() == [0, 7, 2]


def test_a_folder_is_one_services_at_a_time(tmp_path: Path) -> None:
    first = FetchCache(tmp_path / "c", 1000).claim()
    with pytest.raises(DatasetError, match="in use by another running service"):
        FetchCache(tmp_path / "c", 1000).claim()
    os.close(first)
    os.close(FetchCache(tmp_path / "c", 1000).claim())


def test_an_index_that_cannot_be_saved_is_only_not_kept(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "c", 1 << 20)

    def full_disk(folder: Path) -> None:
        raise OSError(28, "No space left on device")

    assert not cache.save_index("k", [], full_disk)
    assert cache.used() == 0 and cache.saved_index("k", []) is None


# --- NOTE [ A private cache folder ] -------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user: needs root")


def _as_nobody(*command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["runuser", "-u", "nobody", "--", *command], check=False, capture_output=True)


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A folder another user can reach (pytest's own folders are root's alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="dataferry-test-", dir="/tmp"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@needs_root
def test_under_a_group_umask_the_folder_is_the_services_alone(reachable: Path) -> None:
    """The shipped unit's ``UMask=0007`` with the folder's group the trainers' (nogroup here): a
    process of another user in that group can neither write a saved index nor list the entries,
    where it can in a folder made as the umask says."""
    old = os.umask(0o007)
    try:
        cache = FetchCache(reachable / "c", 1 << 20)
        key = index_key("tar", "/data", None)
        assert cache.save_index(key, [1], lambda folder: (folder / "index.json").write_text("{}"))
        (reachable / "plain").mkdir()
    finally:
        os.umask(old)
    for folder in (cache.dir, reachable / "plain"):
        os.chown(folder, 0, 65534)
    assert _as_nobody("touch", str(reachable / "plain" / "x")).returncode == 0, "the umask's folder is open"
    assert stat.S_IMODE(cache.dir.stat().st_mode) == 0o700
    saved = cache.indexes / key / "index.json"
    assert _as_nobody("sh", "-c", f"echo planted > {saved}").returncode != 0
    assert _as_nobody("touch", str(cache.dir / "x")).returncode != 0
    assert _as_nobody("ls", str(cache.indexes)).returncode != 0
    assert saved.read_text() == "{}"


def test_a_folder_others_could_write_in_is_emptied_and_made_private(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "c"
    (folder / "indexes" / "k").mkdir(parents=True)
    (folder / "indexes" / "k" / "inputs.json").write_text("[1]")
    (folder / "objects").mkdir()
    (folder / "objects" / "planted").write_bytes(b"x")
    os.chmod(folder, 0o770)
    cache = FetchCache(folder, 1 << 20)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert cache.saved_index("k", [1]) is None and not any(cache.objects.iterdir())
    assert "was writable by others" in caplog.text
    os.chmod(folder, 0o750)  # readable only: kept, made private
    (folder / "objects" / "kept").write_bytes(b"x")
    FetchCache(folder, 1 << 20)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and (folder / "objects" / "kept").exists()


@needs_root
def test_a_folder_another_user_owns_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(DatasetError, match="belongs to uid 65534"):
        FetchCache(folder, 1 << 20)
