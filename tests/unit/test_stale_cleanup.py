"""Start-up cleanup (``shm.remove_stale``) in a hostile directory.

/dev/shm and the temp dir are shared with every user of the machine: anyone may leave FIFOs, links,
odd names or folders there that look like ours, and entries change while we scan. Cleanup must never
block, crash or remove anything but a dead service's own segments and runtime folders. Each call runs
in a thread with a deadline, so a blocking open fails the test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader_service import shm
from loader_service.shm import LOCK_NAME, remove_stale
from tests.helpers import shm_segment

DEADLINE = 10.0
OTHER_UID = 65534  # nobody
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A stand-in for /dev/shm; at teardown every FIFO in or near it gets a writer, which releases
    a reader an old cleanup may have left blocked in ``open``."""
    folder = tmp_path / "shm"
    folder.mkdir()
    yield folder
    for path in tmp_path.rglob("*"):
        if path.is_fifo():
            release_fifo(path)


def bounded(call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread; fail if it has not returned within DEADLINE seconds."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as exc:  # re-raised in the test's thread
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"remove_stale blocked for over {DEADLINE} s"
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def clean(folder: Path) -> list[str]:
    return list(bounded(lambda: remove_stale((folder,))))


def runtime_folder(path: Path) -> Path:
    """A runtime folder as a service leaves it: lock file, index files, a FIFO of its own."""
    (path / "feed0").mkdir(parents=True)
    (path / "feed0" / "paths.bin").write_bytes(b"x" * 100)
    (path / LOCK_NAME).write_bytes(b"")
    os.mkfifo(path / "pipe")
    return path


def release_fifo(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader is waiting


# --- what must still be removed, and what must still be spared --------------------------------


def test_a_dead_services_segment_and_runtime_folder_are_removed(shm_dir: Path, dead_pid: int) -> None:
    segment = shm_dir / f"dataferry-{dead_pid}-train-0a1b2c3d"
    segment.write_bytes(b"\0" * 4096)
    folder = runtime_folder(shm_dir / f"dataferry-{dead_pid}-k2x_9q7z")
    assert sorted(clean(shm_dir)) == sorted([str(segment), str(folder)])
    assert not segment.exists() and not folder.exists()


def test_the_scratch_of_a_killed_index_scan_is_removed(shm_dir: Path) -> None:
    """A scan killed with SIGKILL (``loader-service index``, or a start) leaves the folder it fetched
    shards or a list into; it is named with its pid and flocked (``shm.scratch_folder``), so the
    next start removes it, and spares the scratch of a scan still running (in any PID namespace)."""
    make = (  # the process's command line does not say loader-service: its flock alone spares it
        "import sys; from pathlib import Path; from loader_service.shm import scratch_folder\n"
        "with scratch_folder(sys.argv[2], Path(sys.argv[1])) as d:\n"
        "    (d / 'train-000001.tar').write_bytes(b'x' * 4096)\n"
        "    print(d, flush=True); sys.stdin.read()\n"
    )
    with contextlib.ExitStack() as stack:
        children = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-c", make, str(shm_dir), purpose],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            for purpose in ("scan", "list")
        ]
        for child in children:
            stack.callback(child.kill)
        made = [Path(child.stdout.readline().strip()) for child in children if child.stdout]
        assert all(folder.is_dir() for folder in made)
        assert clean(shm_dir) == [], "a running scan's scratch is spared"
        for child in children:
            child.kill()
            child.wait()
        assert sorted(clean(shm_dir)) == sorted(str(folder) for folder in made)


def test_a_segment_whose_holder_keeps_its_flock_is_spared(shm_dir: Path, dead_pid: int) -> None:
    """A live service in another PID namespace: its pid looks dead from here, its flock says alive."""
    segment = shm_dir / f"dataferry-{dead_pid}-train-0a1b2c3d"
    folder = runtime_folder(shm_dir / f"dataferry-{dead_pid}-k2x_9q7z")
    fds = [os.open(segment, os.O_CREAT | os.O_RDWR, 0o600), os.open(folder / LOCK_NAME, os.O_RDWR)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert clean(shm_dir) == []
        assert segment.exists() and folder.exists()
    finally:
        for fd in fds:
            os.close(fd)


def test_this_process_own_segments_are_spared(shm_dir: Path) -> None:
    segment = shm_dir / f"dataferry-{os.getpid()}-train-0a1b2c3d"
    segment.write_bytes(b"")
    assert clean(shm_dir) == []
    assert segment.exists()


def test_a_segment_a_test_makes_survives_a_service_starting_beside_it() -> None:
    """``tests.helpers.shm_segment`` holds its flock as a service does: a test process is no service
    by its command line, and before, a service another test worker started removed a test's segment
    in the middle of the test (seen as a FileNotFoundError in test_batch under load)."""
    with shm_segment("probe", 4096, lambda m: None) as name:
        cleanup = "from loader_service.shm import remove_stale; print(remove_stale())"
        out = subprocess.run([sys.executable, "-c", cleanup], capture_output=True, text=True, check=True)
        assert name not in out.stdout and (Path("/dev/shm") / name).exists()


# --- hostile entries ----------------------------------------------------------------------------


def test_a_fifo_named_like_a_dead_segment_neither_blocks_nor_is_removed(shm_dir: Path, dead_pid: int) -> None:
    fifo = shm_dir / f"dataferry-{dead_pid}-train-0a1b2c3d"
    os.mkfifo(fifo)
    assert clean(shm_dir) == []
    assert fifo.is_fifo()


def test_links_named_like_dead_segments_are_left_and_their_targets_untouched(
    shm_dir: Path, dead_pid: int, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    os.mkfifo(outside / "pipe")
    links = {
        shm_dir / f"dataferry-{dead_pid}-train-0a1b2c3d": outside / "precious",
        shm_dir / f"dataferry-{dead_pid}-train-1a1b2c3d": outside / "pipe",  # opening it would block
        shm_dir / f"dataferry-{dead_pid}-k2x_9q7z": outside,  # a "runtime folder" elsewhere
    }
    for link, target in links.items():
        link.symlink_to(target)
    assert clean(shm_dir) == []
    assert all(link.is_symlink() for link in links)
    assert (outside / "precious").read_bytes() == b"keep me" and (outside / "pipe").is_fifo()


@pytest.mark.parametrize("digits", ["arabic-indic", "superscript"])
def test_names_whose_pid_is_not_ascii_digits_are_not_ours(shm_dir: Path, dead_pid: int, digits: str) -> None:
    # str.isdigit() accepts both; int() reads the first as a pid and raises on the second.
    head = str(dead_pid).translate(ARABIC_INDIC) if digits == "arabic-indic" else "²³"
    entry = shm_dir / f"dataferry-{head}-train-0a1b2c3d"
    entry.write_bytes(b"")
    assert clean(shm_dir) == []
    assert entry.exists()


def test_names_that_do_not_match_ours_exactly_are_left(shm_dir: Path, dead_pid: int) -> None:
    names = [f"dataferry-{dead_pid}", f"dataferry-{dead_pid}-", f"dataferry-{dead_pid}-a b", "dataferry-x-1"]
    for name in names:
        (shm_dir / name).write_bytes(b"")
    assert clean(shm_dir) == []
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted(names)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_entries_of_another_user_are_left(shm_dir: Path, dead_pid: int) -> None:
    segment = shm_dir / f"dataferry-{dead_pid}-train-0a1b2c3d"
    segment.write_bytes(b"")
    folder = runtime_folder(shm_dir / f"dataferry-{dead_pid}-k2x_9q7z")
    for path in (segment, folder):
        os.chown(path, OTHER_UID, OTHER_UID)
    assert clean(shm_dir) == []
    assert segment.exists() and (folder / "feed0" / "paths.bin").exists()


def test_a_scan_directory_that_is_missing_or_not_a_folder_is_skipped(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    assert bounded(lambda: remove_stale((tmp_path / "missing", not_a_folder))) == []


# --- entries that change under the scan ---------------------------------------------------------


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_file(path: Path) -> None:
    path.write_bytes(b"")


def make_link(path: Path) -> None:
    path.symlink_to(path.parent.parent / "outside")


SWAPS: dict[str, tuple[str, Callable[[Path], None] | None, bool]] = {
    # name: (what the scan saw, what replaces it before cleanup looks, is the replacement removed)
    "file-vanishes": ("file", None, False),
    "folder-vanishes": ("folder", None, False),
    "folder-becomes-file": ("folder", make_file, True),  # a dead service's segment after all
    "folder-becomes-fifo": ("folder", make_fifo, False),
    "file-becomes-fifo": ("file", make_fifo, False),
    "file-becomes-link": ("file", make_link, False),
    "folder-becomes-link": ("folder", make_link, False),
}


def remove_entry(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


class RacingScan:
    """A scandir iterator that changes ``target`` on disk right after handing out its entry, before
    the caller can look at it: the entry's cached type is then stale."""

    def __init__(self, scan: Any, target: Path, replacement: Callable[[Path], None] | None) -> None:
        self.scan = scan
        self.target = target
        self.replacement = replacement

    def __enter__(self) -> RacingScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.scan.close()

    def __iter__(self) -> RacingScan:
        return self

    def __next__(self) -> os.DirEntry[str]:
        found: os.DirEntry[str] = next(self.scan)
        if found.path == str(self.target):
            remove_entry(self.target)
            if self.replacement is not None:
                self.replacement(self.target)
        return found

    def close(self) -> None:
        self.scan.close()


@pytest.mark.parametrize("swap", list(SWAPS))
def test_an_entry_that_vanishes_or_changes_type_mid_scan_is_handled(
    shm_dir: Path, dead_pid: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    seen_as, replacement, removed = SWAPS[swap]
    (tmp_path / "outside").write_bytes(b"keep me")
    entry = shm_dir / f"dataferry-{dead_pid}-k2x_9q7z"
    if seen_as == "folder":
        runtime_folder(entry)
    else:
        entry.write_bytes(b"")
    real_scandir = os.scandir

    def racing_scandir(path: Any = ".") -> Any:
        if path != shm_dir:
            return real_scandir(path)  # the folders cleanup walks inside an entry it removes
        return RacingScan(real_scandir(path), entry, replacement)

    monkeypatch.setattr(os, "scandir", racing_scandir)
    try:
        result = clean(shm_dir)
    finally:
        monkeypatch.undo()
        if entry.is_fifo():
            release_fifo(entry)
    assert result == ([str(entry)] if removed else [])
    assert os.path.lexists(entry) == (replacement is not None and not removed)
    assert (tmp_path / "outside").read_bytes() == b"keep me"


@pytest.mark.parametrize("seen_as", ["file", "folder"])
def test_an_entry_swapped_for_a_fifo_after_its_lstat_is_not_opened_blocking(
    shm_dir: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch, seen_as: str
) -> None:
    """The narrowest race: the entry passes its lstat check, then becomes a FIFO before the open."""
    entry = shm_dir / f"dataferry-{dead_pid}-k2x_9q7z"
    if seen_as == "folder":
        runtime_folder(entry)
    else:
        entry.write_bytes(b"")
    real_lstat = os.lstat
    swapped: list[bool] = []

    def racing_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == str(entry) and not swapped:
            swapped.append(True)
            monkeypatch.undo()  # the swap itself must not race
            remove_entry(entry)
            os.mkfifo(entry)
        return result

    monkeypatch.setattr(os, "lstat", racing_lstat)
    try:
        result = clean(shm_dir)
    finally:
        monkeypatch.undo()
        release_fifo(entry)
    assert result == []
    assert entry.is_fifo()


def test_an_os_error_on_one_entry_is_logged_at_debug_and_the_scan_goes_on(
    shm_dir: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    refused = shm_dir / f"dataferry-{dead_pid}-a-0a1b2c3d"
    segment = shm_dir / f"dataferry-{dead_pid}-b-0a1b2c3d"
    for path in (refused, segment):
        path.write_bytes(b"")
    real_lstat = os.lstat

    def refusing_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == str(refused):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(refused))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", refusing_lstat)
    with caplog.at_level("DEBUG", logger=shm.__name__):
        result = clean(shm_dir)
    monkeypatch.undo()
    assert result == [str(segment)] and refused.exists()
    assert [r.levelname for r in caplog.records if refused.name in r.getMessage()] == ["DEBUG"]
    assert all(r.levelname == "DEBUG" for r in caplog.records)
