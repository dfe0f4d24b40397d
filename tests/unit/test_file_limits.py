"""Dataset files that are not regular files, or too large, are bad samples found without blocking.

A FIFO in the dataset would hang a decode worker until ``--task-timeout``, a link to /dev/zero would
read until memory runs out, and one huge file would take the worker's memory with it. Reads run in
a thread with a deadline, so a blocking open fails the test instead of hanging the run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from loader_service.config import ConfigError, load_config
from loader_service.dataset.storage.local import read_file
from protocol.pixels import DecodeError

DEADLINE = 10.0
MIB = 2**20


def bounded(call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread; fail if it has not returned within DEADLINE seconds."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # re-raised in the test's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"read_file blocked for over {DEADLINE} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "fifo.jpg"
    os.mkfifo(path)
    yield path
    try:  # a writer releases a reader left blocked in open() by a failing run
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody was waiting


def read_error(path: Path, max_bytes: int = 256 * MIB) -> str:
    with pytest.raises(DecodeError) as caught:
        bounded(lambda: read_file(str(path), max_bytes))
    return str(caught.value)


def test_a_fifo_is_not_a_regular_file_and_does_not_block(fifo: Path) -> None:
    assert read_error(fifo) == "not a regular file: a FIFO"


def test_a_link_to_a_device_is_not_a_regular_file(tmp_path: Path) -> None:
    link = tmp_path / "zero.jpg"
    link.symlink_to("/dev/zero")
    assert read_error(link) == "not a regular file: a character device"


def test_a_folder_is_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "folder.jpg").mkdir()
    assert read_error(tmp_path / "folder.jpg") == "not a regular file: a directory"


def test_a_file_over_the_limit_is_refused_and_one_at_it_read(tmp_path: Path) -> None:
    ok, big = tmp_path / "ok.jpg", tmp_path / "big.jpg"
    ok.write_bytes(b"x" * 100)
    big.write_bytes(b"x" * 101)
    assert bounded(lambda: read_file(str(ok), 100)) == b"x" * 100
    assert read_error(big, 100) == "file of 101 bytes is over --max-file-bytes 100"


def test_a_file_that_grows_past_the_limit_while_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fstat said 50 bytes, then the file turned out longer: no more than limit + 1 bytes are read."""
    path = tmp_path / "growing.jpg"
    path.write_bytes(b"x" * 10_000)
    real_stat, real_fstat, real_read = os.stat, os.fstat, os.read
    asked: list[int] = []

    def before_growth(st: os.stat_result) -> os.stat_result:
        return os.stat_result((*st[:6], 50, *st[7:10]))  # st_size is field 6

    def counting_read(fd: int, n: int) -> bytes:
        asked.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: before_growth(real_stat(path, *a, **k)))
    monkeypatch.setattr(os, "fstat", lambda fd: before_growth(real_fstat(fd)))
    monkeypatch.setattr(os, "read", counting_read)
    try:
        with pytest.raises(DecodeError) as caught:
            read_file(str(path), 100)
    finally:
        monkeypatch.undo()
    assert str(caught.value) == "file grew over --max-file-bytes 100 while it was read"
    assert sum(asked) <= 101, f"asked for {asked}: more than one byte past the limit"


def test_good_and_empty_files_read_as_before(tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    assert cv2.imwrite(str(image), np.zeros((8, 8, 3), np.uint8))
    assert read_file(str(image)) == image.read_bytes()
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert read_error(tmp_path / "empty.jpg") == "empty file"
    assert read_error(tmp_path / "gone.jpg").startswith("cannot read: ")


# --- the option --------------------------------------------------------------------------------


def test_max_file_bytes_defaults_to_256_mib_and_reaches_every_feed(tmp_path: Path) -> None:
    base = {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"}
    assert load_config(None, base, environ={}).max_file_bytes == 256 * MIB
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(f'max_file_bytes = 1000\n[feeds.val]\ndata = "{tmp_path}"\n')
    config = load_config(cfg_file, base, environ={"DATAFERRY_MAX_FILE_BYTES": "2000"})
    assert [feed.max_file_bytes for feed in config.feeds()] == [2000, 2000]


def test_max_file_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_file_bytes must be at least 1"):
        load_config(None, {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock", "max_file_bytes": 0})
