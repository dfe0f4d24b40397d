"""NOTE [ A service's identity ]: who listens on a socket, which folders make a listener trustworthy,
and which segments a trainer maps, on real sockets and files."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker.peer import (
    Credentials,
    check_listener,
    check_segment,
    listener_of,
    peer_credentials,
    trusted_listener,
)

OTHER_UID = 65534


def test_the_listener_is_the_process_that_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        peer = listener_of(path)
        assert (peer.pid, peer.uid) == (os.getpid(), os.geteuid())
        assert check_listener(f"ipc://{path}", peer) == peer
    assert check_listener("tcp://127.0.0.1:5555", None) is None, "no credentials travel over TCP"
    with pytest.raises(ValueError, match="cannot tell who listens"):
        check_listener(f"ipc://{path}", None)  # no credentials came with the welcome


@pytest.fixture
def root_folder() -> Iterator[Path]:
    """A folder as /run is: root's, 0755, in folders only root may write in."""
    if os.geteuid() != 0 or os.stat("/run").st_uid != 0 or os.stat("/run").st_mode & 0o022:
        pytest.skip("needs root, and /run root's and closed to other users' writes")
    folder = Path(tempfile.mkdtemp(prefix="dataferry-peer-", dir="/run"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _their_socket(folder: Path, uid: int = OTHER_UID, mode: int = 0o750) -> str:
    """A socket file of ``uid``'s in ``folder``, made ``uid``'s with ``mode`` (as RuntimeDirectory=)."""
    folder.mkdir(exist_ok=True)
    path = folder / "train.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as made:
        made.bind(str(path))
    os.chown(path, uid, -1)
    os.chown(folder, uid, -1)
    folder.chmod(mode)
    return str(path)


def test_this_user_and_root_are_trusted_anywhere(tmp_path: Path) -> None:
    path = str(tmp_path / "train.sock")
    assert trusted_listener(os.geteuid(), path) and trusted_listener(0, path)
    if os.geteuid() != 0:
        assert not trusted_listener(OTHER_UID, path), "a folder of ours is no proof of theirs"


def test_another_user_is_trusted_only_where_only_it_and_root_could_have_bound(root_folder: Path) -> None:
    path = _their_socket(root_folder / "dataferry")
    assert trusted_listener(OTHER_UID, path), "/run/dataferry: theirs, 0750, in root's /run"
    for open_to_others in (0o770, 0o1777, 0o757):
        (root_folder / "dataferry").chmod(open_to_others)
        assert not trusted_listener(OTHER_UID, path), f"mode {open_to_others:o}: anyone could have bound it"
    (root_folder / "dataferry").chmod(0o750)
    os.chown(root_folder / "dataferry", 0, -1)
    assert not trusted_listener(OTHER_UID, path), "root's folder proves nothing of another user"
    os.chown(root_folder / "dataferry", OTHER_UID, -1)
    os.chown(path, 0, -1)
    assert not trusted_listener(OTHER_UID, path), "a socket file of someone else's"


def test_a_folder_of_theirs_where_anyone_could_have_made_it_proves_nothing(
    root_folder: Path, tmp_path: Path
) -> None:
    """Before the fix a folder of the listener's that only it may write in was enough: any user
    can make one, 0755, in /tmp. Now every folder above must be root's or theirs, closed to others."""
    shared = root_folder / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    path = _their_socket(shared / "mine", mode=0o755)
    assert not trusted_listener(OTHER_UID, path), "their 0755 folder in a folder anyone writes in"
    above = root_folder / "theirs"
    above.mkdir()
    os.chown(above, OTHER_UID + 1, -1)  # a third user's folder, 0755: they could swap ours
    path = _their_socket(above / "run")
    assert not trusted_listener(OTHER_UID, path), "a folder above of a third user's"
    link = root_folder / "dataferry"
    link.symlink_to(above / "run")
    os.chown(above, OTHER_UID, -1)
    assert trusted_listener(OTHER_UID, path)
    assert not trusted_listener(OTHER_UID, str(link / "train.sock")), "reached through a link"


def test_the_credentials_are_those_libzmq_read_of_the_connection() -> None:
    """``Peer-Address`` of an ipc message: ``host:uid:gid:pid`` (SO_PEERCRED of that connection)."""
    assert peer_credentials("localhost:65534:65533:4242") == Credentials(4242, 65534, 65533)
    for unusable in ("", "127.0.0.1:5555", "localhost:a:b:c", "localhost:-1:0:1"):
        assert peer_credentials(unusable) is None, unusable


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
