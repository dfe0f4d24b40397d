"""Nobody else's batches: a trainer believes only its own private service, a listener it may trust
and a pool that listener owns (NOTE [ A private service ] in gpu_worker/local.py, NOTE [ A service's
identity ] in gpu_worker/peer.py). Another local user is real here: ``runuser -u nobody`` for a
script of the standard library, or a process of this test that drops to ``nobody`` after its imports
(the project's interpreter may live where ``nobody`` cannot run it)."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker import ServiceError, ServiceLoader
from loader_service.shm import remove_stale
from tests.helpers import REPO, ServiceFactory, epoch_indices

pytestmark = pytest.mark.integration


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


NOBODY = _nobody()
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None, reason="needs root, to act as the user nobody"
)
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

# What the review's attacker did: watch /proc for the private service's command line, bind the
# endpoint named there and say READY where the trainer listened (an abstract name derived from it).
ATTACKER = r"""
import json, os, socket, sys, time
marker = sys.argv[1].encode()
print("watching", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"--stop-with-stdin" not in argv or marker not in argv or b"--endpoint" not in argv:
            continue
        path = argv[argv.index(b"--endpoint") + 1].decode()[len("ipc://"):]
        report = {}
        try:
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.bind(path)
            held.listen()
            report["bound"] = True
        except OSError as exc:
            report["bound"] = exc.strerror
        name = os.path.basename(path)[: -len(".sock")]
        try:
            note = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            note.sendto(b"READY=1", "\0" + name)
            report["notified"] = True
        except OSError as exc:
            report["notified"] = exc.strerror
        print(json.dumps(report), flush=True)
        time.sleep(5)
        sys.exit(0)
print(json.dumps({"found": False}), flush=True)
"""


@needs_root
@pytest.mark.skipif(
    shutil.which("runuser") is None or SYSTEM_PYTHON is None, reason="needs runuser and python3"
)
def test_another_user_can_neither_bind_nor_announce_a_private_service(photos: Path) -> None:
    """Before the fix the attacker bound the path and notified READY (the review's trainer then
    trained on its batches); now the folder is 0700 and readiness comes on an inherited socket."""
    assert SYSTEM_PYTHON is not None
    marker = str(photos)
    with subprocess.Popen(
        ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", ATTACKER, marker],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as attacker:
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "watching"
            with ServiceLoader.local(photos, workers=1, batch_size=8, image_size=32) as loader:
                seen, _ = epoch_indices(loader)
                assert loader._private is not None
                folder = os.path.dirname(loader._private.endpoint[len("ipc://") :])
                folder_mode = os.stat(folder).st_mode & 0o7777
            report = json.loads(attacker.stdout.readline())
        finally:
            os.killpg(attacker.pid, signal.SIGKILL)
    assert report.get("found", True), "the attacker never saw the service's command line"
    assert report["bound"] is not True, f"another user bound the private service's socket: {report}"
    assert report["notified"] is not True, f"another user could announce READY: {report}"
    assert sorted(seen) == list(range(90)), "the trainer got its own service's epoch"
    assert folder_mode == 0o700, "the socket's folder is this user's alone"


def test_a_private_service_that_dies_fails_the_loop_at_once_with_its_exit_code(photos: Path) -> None:
    """Before: the loader reconnected to nothing until its ``timeout`` ran out."""
    with ServiceLoader.local(photos, workers=1, batch_size=8, image_size=32, timeout=30) as loader:
        batches = iter(loader)
        next(batches)
        assert loader._private is not None
        os.kill(loader._private.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ServiceError, match=r"exited with code -9 while the loader used it"):
            for _ in batches:
                pass
        assert time.monotonic() - start < 5, "noticed at the next wait, not after the timeout"
        remove_stale()  # what a SIGKILLed service leaves, as the next service to start removes it


# A service of another user, as far as a trainer can tell: it drops to ``nobody`` after its imports,
# binds the endpoint and welcomes every hello with a feed whose pool it made (or, with ``root``, one
# made before it dropped root); given a link and another path, it first points the link there. A
# session socket of a service that was there before, reconnected to it by libzmq, names the run and
# the batches it waits for (``want``): it is told the run goes on (a heartbeat), and once its ``ack``
# says which lease came last, the next lease is announced in slot 0 of the pool it still maps.
IMPOSTOR = r"""
import secrets, sys
import zmq
from protocol.codec import decode, encode
from protocol.layout import CHECK_BYTES, SlotLayout
from protocol.messages import Ack, BatchReady, FeedInfo, Heartbeat, Hello, Want, Welcome
from loader_service.shm import Segment, new_segment_name

endpoint, pool_owner = sys.argv[1], sys.argv[2]
link, elsewhere = sys.argv[3:5] if len(sys.argv) > 3 else ("", "")
layout = SlotLayout.images(8, 32)
check = secrets.token_bytes(CHECK_BYTES)

def make_pool():
    segment = Segment.create(new_segment_name("impostor"), layout.mapped_bytes(4))
    end = layout.segment_bytes(4)
    segment.buf[end : end + CHECK_BYTES] = check
    return segment

pool = make_pool() if pool_owner == "root" else None
import os
os.setgid(65534)
os.setuid(65534)
pool = pool or make_pool()
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(endpoint)
print(pool.name, flush=True)
waiting, announced = {}, set()
while True:
    peer, frame = sock.recv_multipart()
    try:
        msg = decode(frame, (Hello, Want, Ack))
    except Exception:
        continue  # heartbeats and the like: an impostor need not answer them
    if isinstance(msg, Want):
        waiting[peer] = (msg.run, msg.seqs[0])
        sock.send_multipart([peer, encode(Heartbeat(run=msg.run))])
        continue
    if isinstance(msg, Ack):
        if peer in waiting and peer not in announced:
            run, seq = waiting[peer]
            sock.send_multipart([peer, encode(BatchReady(run, 0, seq, msg.have + 1, 0, 8))])
            announced.add(peer)
        continue
    if link:  # connected through ``link``: point it at another listener before answering
        os.symlink(elsewhere, link + ".new")
        os.replace(link + ".new", link)
        link = ""
    feed = FeedInfo("train", 90, 1, 8, 32, 12, 0, "none", "ff" * 16, pool.name, 4, layout.wire(), check.hex())
    welcome = Welcome("s1", feed, 1.0, 12, 90, token=secrets.token_hex(16), credits=4)
    sock.send_multipart([peer, encode(welcome)])
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder in the shared temp folder that the test hands to ``nobody`` as it needs."""
    path = Path(tempfile.mkdtemp(prefix="dataferry-identity-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_folder() -> Iterator[Path]:
    """A service's runtime folder as systemd's ``RuntimeDirectory=`` makes it (deploy/): in a folder
    only root may write in, owned by the service's user (``nobody`` here), 0750."""
    assert NOBODY is not None
    if os.stat("/run").st_uid != 0 or os.stat("/run").st_mode & 0o022:
        pytest.skip("needs /run to be root's and closed to other users' writes")
    parent = Path(tempfile.mkdtemp(prefix="dataferry-identity-", dir="/run"))
    try:
        parent.chmod(0o755)
        folder = parent / "dataferry"
        folder.mkdir(mode=0o750)
        os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
        yield folder
    finally:
        shutil.rmtree(parent, ignore_errors=True)


class Impostor:
    """``IMPOSTOR`` running; ``stop`` ends it and removes its pool (root may, in sticky /dev/shm)."""

    def __init__(self, endpoint: str, pool_owner: str, *swap: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IMPOSTOR, endpoint, pool_owner, *swap],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.pool = self.proc.stdout.readline().strip()
        if not self.pool.startswith("dataferry-"):
            self.stop()
            raise AssertionError("the impostor did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.pool:
            Path("/dev/shm", self.pool).unlink(missing_ok=True)


def refused_as_nobody(folder: Path) -> None:
    """A ``nobody`` process listening in ``folder`` is refused, naming its uid."""
    endpoint = f"ipc://{folder / 'train.sock'}"
    impostor = Impostor(endpoint, "nobody")
    try:
        with pytest.raises(ServiceError, match=r"runs as uid 65534"):
            ServiceLoader(endpoint, timeout=10, connect_timeout=10)
    finally:
        impostor.stop()


@needs_root
def test_a_listener_of_another_user_where_anyone_may_bind_is_refused(folder: Path) -> None:
    """A folder like /tmp (1777, root's): a ``nobody`` process listening there is not believed.
    Before the fix the trainer took its welcome and mapped the pool it named."""
    folder.chmod(0o1777)
    refused_as_nobody(folder)


@needs_root
def test_a_listener_that_takes_a_gone_services_path_gets_nothing_into_its_session(
    folder: Path, photos: Path, start_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A service of this user in a folder anyone may bind in (1777) is believed; once it is gone,
    libzmq reconnects the trainer's session socket to whoever binds that path next, with no new
    welcome to check. Before the fix a ``nobody`` listener there kept the session alive with its
    heartbeats and the trainer took the batch it announced in slot 0 of the old pool, still mapped
    (the first batch's pixels again, as the third); now the first message from another process ends
    the session, and the new hello's welcome is refused, naming that process's uid."""
    folder.chmod(0o1777)
    endpoint = f"ipc://{folder / 'train.sock'}"
    # Heartbeats every 2 s: the trainer keeps a silent service's session 10 s, which on a busy
    # machine leaves the impostor time to bind before the trainer would reconnect of its own accord.
    service = start_service(photos, endpoint=endpoint, heartbeat_interval=2)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="gpu_worker"),
            ServiceLoader(endpoint, credits=2, transport="shm", timeout=30, connect_timeout=10) as loader,
        ):
            batches = iter(loader)
            held = [next(batches), next(batches)]  # both credits: the service can announce no more
            service.kill_group()  # SIGKILL: not a word to the trainer
            # What a killed service leaves behind (its next start removes it; in a sticky folder
            # only its owner or root may): the path is free for anyone to bind.
            (folder / "train.sock").unlink()
            impostor = Impostor(endpoint, "nobody")
            try:
                del held  # their releases and the next batch's ``want`` go out on the old socket
                with pytest.raises(ServiceError, match=r"runs as uid 65534"):
                    stolen = next(batches)
                    pytest.fail(f"the trainer took batch {stolen.seq} from uid 65534 into its session")
            finally:
                impostor.stop()
    finally:
        remove_stale()  # the killed service's pool, as its next start would
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost the loader service")]
    assert any(f"pid {impostor.proc.pid}" in why and f"pid {service.proc.pid}" in why for why in lost), (
        f"the session ended on the impostor's first message, naming both processes: {lost}"
    )


@needs_root
def test_a_listener_in_a_folder_another_user_made_in_the_shared_temp_folder_is_refused(folder: Path) -> None:
    """``nobody``'s own folder, 0755, but in /tmp, where anyone could have made it first: it proves
    nothing. Before the fix it passed the check (a folder of the listener's that only it may write
    in) and the trainer took ``nobody``'s batches."""
    assert NOBODY is not None
    os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    folder.chmod(0o755)
    refused_as_nobody(folder)


@needs_root
def test_the_listener_checked_is_the_one_that_answered_not_a_name_swapped_since(
    folder: Path, tmp_path: Path
) -> None:
    """The trainer connects through a link ``nobody`` controls, to ``nobody``'s listener, which then
    points the link at a listener of root's before it answers. Before the fix the check connected
    again, through the link, found root, and the trainer mapped the pool ``nobody`` named; now the
    credentials are those of the connection the welcome came on."""
    assert NOBODY is not None
    os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    root_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    root_listener.bind(str(tmp_path / "root.sock"))
    root_listener.listen()
    link = folder / "train.sock"
    link.symlink_to(folder / "impostor.sock")
    impostor = Impostor(f"ipc://{folder / 'impostor.sock'}", "root", str(link), str(tmp_path / "root.sock"))
    try:
        with pytest.raises(ServiceError, match=r"runs as uid 65534"):
            ServiceLoader(f"ipc://{link}", transport="shm", timeout=10, connect_timeout=10)
        assert os.readlink(link) == str(tmp_path / "root.sock"), "the link was swapped before the check"
    finally:
        impostor.stop()
        root_listener.close()


@needs_root
def test_a_pool_owned_by_another_user_than_the_listener_is_not_mapped(run_folder: Path) -> None:
    """A service's own runtime folder (``nobody``'s, 0750, in root's /run) is trusted, and so is the
    pool it owns; a pool it names that another user owns is not mapped (a shrink of it would SIGBUS
    the trainer)."""
    endpoint = f"ipc://{run_folder / 'train.sock'}"
    impostor = Impostor(endpoint, "nobody")
    try:
        with ServiceLoader(endpoint, transport="shm", timeout=10, connect_timeout=10) as loader:
            assert loader.transport == "shm", "its own pool, announced by a trusted listener, is mapped"
    finally:
        impostor.stop()
    impostor = Impostor(endpoint, "root")
    try:
        with pytest.raises(ServiceError, match=r"owned by uid 0, not the service's uid 65534"):
            ServiceLoader(endpoint, transport="shm", timeout=10, connect_timeout=10)
    finally:
        impostor.stop()
