"""NOTE [ A service's identity ]: who listens on a socket, which folders make a listener trustworthy,
and which segments a trainer maps, on real sockets and files."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gpu_worker.peer import check_listener, check_segment, listener_of, trusted_listener

OTHER_UID = 65534


def test_the_listener_is_the_process_that_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        peer = listener_of(path)
        assert (peer.pid, peer.uid) == (os.getpid(), os.geteuid())
        assert check_listener(f"ipc://{path}") == peer
    assert check_listener("tcp://127.0.0.1:5555") is None, "no credentials travel over TCP"
    with pytest.raises(ValueError, match="cannot tell who listens"):
        check_listener(f"ipc://{path}")  # nobody listens any more


def test_another_user_is_trusted_only_in_a_folder_of_theirs_nobody_else_writes_in(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    path = str(folder / "train.sock")
    assert trusted_listener(os.geteuid(), path) and trusted_listener(0, path)
    if os.geteuid() != 0:
        assert not trusted_listener(OTHER_UID, path), "a folder of ours is no proof of theirs"
        return
    os.chown(folder, OTHER_UID, -1)
    folder.chmod(0o750)
    assert trusted_listener(OTHER_UID, path), "/run/dataferry: theirs, 0750"
    for open_to_others in (0o770, 0o1777, 0o757):
        folder.chmod(open_to_others)
        assert not trusted_listener(OTHER_UID, path), f"mode {open_to_others:o}: anyone could have bound it"
    os.chown(folder, 0, -1)
    folder.chmod(0o750)
    assert not trusted_listener(OTHER_UID, path), "root's folder proves nothing of another user"


def _segment(tmp_path: Path, mode: int) -> int:
    path = tmp_path / "dataferry-1-train-0"
    path.write_bytes(b"x" * 64)
    path.chmod(mode)
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("mode", [0o600, 0o660, 0o640])
def test_a_segment_of_the_service_open_to_it_and_its_group_is_mapped(tmp_path: Path, mode: int) -> None:
    fd = _segment(tmp_path, mode)
    try:
        check_segment(fd, "s", os.geteuid())
        check_segment(fd, "s", None)
    finally:
        os.close(fd)


def test_a_segment_open_to_everyone_or_of_another_owner_is_refused(tmp_path: Path) -> None:
    fd = _segment(tmp_path, 0o666)
    try:
        with pytest.raises(ValueError, match="open to every user"):
            check_segment(fd, "s", os.geteuid())
    finally:
        os.close(fd)
    fd = _segment(tmp_path, 0o600)
    try:
        with pytest.raises(
            ValueError, match=f"owned by uid {os.geteuid()}, not the service's uid {OTHER_UID}"
        ):
            check_segment(fd, "s", OTHER_UID)
    finally:
        os.close(fd)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            check_segment(fd, "s", None)
    finally:
        os.close(fd)
