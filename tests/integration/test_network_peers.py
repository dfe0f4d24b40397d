"""Peers that do what the protocol allows, badly or on purpose: stop reading, send endless messages,
hold or break a broadcast group. Real services, real ZeroMQ sockets written by hand.
Run with the other network tests: ``pytest tests/integration -k network``.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
import zmq.auth

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.supervisor.edges.curve import CurveGuard, TrainerKeys
from loader_service.tools.keys import KeyPair, make_keys
from protocol.codec import decode, encode
from protocol.curve import ClientKeys
from protocol.messages import Heartbeat, Hello, Start, Welcome
from tests.helpers import ServiceFactory, epoch_indices, in_threads, status, trainer_process, wait_until

pytestmark = pytest.mark.integration


class RawPeer:
    """A hand-made trainer: a DEALER that says hello, may start, and then does only what it is told;
    a second socket heartbeats for it, so only what it reads (or not) can give it away."""

    def __init__(self, endpoint: str, **hello: object) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        self.sock.send(encode(Hello("raw:1", 1, **hello)))  # type: ignore[arg-type]
        assert self.sock.poll(10_000), "no welcome"
        welcome = decode(self.sock.recv(), (Welcome,))
        self.token = welcome.token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(endpoint,), daemon=True)
        self._beat.start()

    def start(self, epoch: int = 0, transport: str = "tcp") -> None:
        self.sock.send(encode(Start(1, epoch, 0, transport, token=self.token)))

    def _heartbeat(self, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        while not self._stop.wait(0.2):
            sock.send(encode(Heartbeat(self.token)), zmq.NOBLOCK)
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._beat.join(5)
        self._ctx.destroy(linger=0)


@contextmanager
def raw_peer(endpoint: str, **hello: object) -> Iterator[RawPeer]:
    peer = RawPeer(endpoint, **hello)
    try:
        yield peer
    finally:
        peer.close()


def test_a_remote_peer_that_stops_reading_loses_its_slots_within_the_client_timeout(
    photos: Path, start_service: ServiceFactory
) -> None:
    """It asks for bytes over the socket (any peer may, even on the ipc socket), takes every slot of
    the pool it may (all but one: NOTE [ Credits per session ]), reads nothing and keeps
    heartbeating. Before NOTE [ Remote sends ] its slots stayed out of the pool as long as ZeroMQ
    was sending them, and the real trainer below timed out."""
    service = start_service(photos, image_size=160, slots=6, client_timeout=2)
    with raw_peer(service.endpoint, credits=6) as peer:
        peer.start()
        wait_until(lambda: status(service.endpoint)["sessions"][0]["leased"] == 5, "the peer holds the pool")
        with ServiceLoader(service.endpoint, timeout=15) as trainer:  # waits for the pool, no longer
            indices, _ = epoch_indices(trainer)
            body = status(service.endpoint)
    assert sorted(indices) == list(range(len(build_index(photos))))
    service.wait_for(r"session t1 \(raw:1\) detached: stopped reading")
    assert body["attached"] == 1, "the peer's session is gone, the trainer's is there"
    batch_bytes = 8 * 3 * 160 * 160 + 2 * 8 * 8  # images, labels, indices
    assert body["remote_send_bytes"] <= 6 * batch_bytes, "its copies stay within its credits"


# --- CURVE: who is let in ---------------------------------------------------------------------


Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]


def curve_pair(guard: CurveGuard, client: KeyPair, server_public: Path) -> Pair:
    """A CURVE server socket secured by ``guard`` and a client with ``client``'s keys, connected."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    guard.secure(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = ClientKeys.load(str(server_public), str(client.secret))
    assert keys is not None
    keys.apply(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return server, sock


def reaches(server: zmq.Socket[bytes], client: zmq.Socket[bytes]) -> bool:
    client.send(b"hello")
    return bool(server.poll(5000))


def test_curve_admits_nobody_when_the_key_handler_is_gone(tmp_path: Path) -> None:
    """Without a ZAP domain libzmq skips the handler it cannot find and admits any key."""
    service = make_keys(tmp_path / "service", "service")
    trainer = make_keys(tmp_path / "trainer", "trainer")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "trainer.key").write_bytes(trainer.public.read_bytes())
    ctx = zmq.Context.instance()
    guard = CurveGuard(ctx, service.secret, allowed)
    try:
        server, client = curve_pair(guard, trainer, service.public)
        assert reaches(server, client), "an authorised key is let in while the handler runs"
        server.close()
        client.close()
    finally:
        guard.stop()
    server, client = curve_pair(guard, trainer, service.public)
    try:
        assert not reaches(server, client), "no handler: nobody is let in"
    finally:
        server.close()
        client.close()


def test_a_reload_skips_a_bad_key_file_and_drops_a_removed_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One malformed file used to make the reload keep the whole old set, removed keys included."""
    folder = tmp_path / "allowed"
    folder.mkdir()
    pairs = {name: make_keys(tmp_path / name, name) for name in ("kept", "removed")}
    for name, pair in pairs.items():
        (folder / f"{name}.key").write_bytes(pair.public.read_bytes())
    keys = TrainerKeys(folder)
    assert keys.reload() == 2
    (folder / "removed.key").unlink()
    (folder / "broken.key").write_text("not a key file\n")
    assert keys.reload() == 1
    public = {name: zmq.auth.load_certificate(str(pair.public))[0] for name, pair in pairs.items()}
    assert keys.callback("*", public["kept"]) and not keys.callback("*", public["removed"])
    assert "skipping trainer key" in caplog.text and "broken.key" in caplog.text


# --- broadcast groups that outsiders cannot break ------------------------------------------------


def group_epoch(endpoint: str, **kwargs: object) -> list[int]:
    with ServiceLoader(endpoint, mode="broadcast", group="sweep", timeout=30, **kwargs) as loader:  # type: ignore[arg-type]
        return epoch_indices(loader)[0]


def test_an_outsider_without_the_group_secret_cannot_join_resize_or_hold_up_the_group(
    photos: Path, start_service: ServiceFactory
) -> None:
    """It names the group first, with group_size 1024, and starts epoch 5: before group secrets its
    size refused every member, and its epoch made their starts fatal."""
    service = start_service(photos)
    with raw_peer(service.endpoint, mode="broadcast", group="sweep", group_size=1024) as outsider:
        outsider.start(epoch=5)
        members = in_threads([lambda: group_epoch(service.endpoint, group_size=2, group_secret="s3")] * 2)
    n = len(build_index(photos))
    assert [sorted(m) for m in members] == [list(range(n))] * 2
    feed = status(service.endpoint)["feeds"][0]
    assert feed["decoded"] - feed["warm_decoded"] >= n, "the members' epoch was decoded"


def test_a_member_that_joins_and_never_starts_is_dropped_after_the_lag_timeout(
    photos: Path, start_service: ServiceFactory
) -> None:
    """It holds the group's first epoch, which waits for every attached member, until evicted."""
    service = start_service(photos, lag_timeout=2)
    with raw_peer(service.endpoint, mode="broadcast", group="sweep", group_size=2):
        members = in_threads([lambda: group_epoch(service.endpoint, group_size=2)] * 2)
    n = len(build_index(photos))
    assert [sorted(m) for m in members] == [list(range(n))] * 2
    service.wait_for(r"session t1 \(raw:1\) evicted: never started")


# --- a limit only an authorised peer can reach -----------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def zmtp_dealer(path: str) -> socket.socket:
    """A DEALER spoken by hand over a Unix socket (ZMTP 3.0, NULL mechanism, RFC 23): unlike libzmq,
    which keeps a message's parts until its last one, it sends each part as it comes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    peer_greeting = b""
    while len(peer_greeting) < 64:
        peer_greeting += sock.recv(64 - len(peer_greeting))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return sock


def test_libzmq_holds_an_unfinished_multipart_message_whole_so_only_authorised_peers_may_connect(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Shown, not fixed: libzmq hands a multipart message over only once its last part is in, and
    MAXMSGSIZE bounds each part, not their number, so the service cannot see or refuse it while it
    grows. No option bounds it; hence every endpoint needs CURVE or file permissions (README,
    Limits). The main loop is not held up meanwhile."""
    service = start_service(photos)
    before = rss_bytes(service.proc.pid)
    peer = zmtp_dealer(service.endpoint[len("ipc://") :])
    try:
        part = b"\x03" + struct.pack(">Q", 60_000) + bytes(60_000)  # MORE | LONG, 60 kB
        for _ in range(1000):  # 60 MB, and never the last part
            peer.sendall(part)
        wait_until(lambda: rss_bytes(service.proc.pid) - before > 40e6, "the service holds the parts")
        assert status(service.endpoint)["attached"] == 0, "the loop still answers"
    finally:
        peer.close()


PAUSE_AFTER_FIRST = """
import os, signal, sys
from gpu_worker import ServiceLoader
loader = ServiceLoader(sys.argv[1], transport="tcp", credits=6, timeout=30)
for batch in loader:
    print("pausing", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # alive, connected, reading nothing, answering nothing
"""


def test_a_paused_remote_trainer_holds_copies_not_slots_and_other_remote_trainers_go_on(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Its session ends after the client timeout (no heartbeat) and its slots return; the copies
    queued on its connection stay until that connection closes (when its process ends: libzmq has
    no way to take them back), bounded by its credits, and do not hold up another remote trainer
    (NOTE [ Remote sends ])."""
    service = start_service(photos, image_size=160, slots=12, client_timeout=2)
    batch_bytes = 8 * 3 * 160 * 160 + 2 * 8 * 8  # images, labels, indices
    paused = trainer_process(service.endpoint, PAUSE_AFTER_FIRST)
    try:
        assert paused.stdout is not None and paused.stdout.readline().strip() == "pausing"
        service.wait_for(r"session t1 \(.*\) detached: (no heartbeat|stopped reading)")
        held = status(service.endpoint)["remote_send_bytes"]
        assert 0 < held <= 6 * batch_bytes, "copies, at most its credits' worth"
        with ServiceLoader(service.endpoint, transport="tcp", timeout=30) as other:
            indices, _ = epoch_indices(other)
        assert sorted(indices) == list(range(len(build_index(photos)))), "the other goes on"
    finally:
        paused.kill()
        paused.communicate(timeout=10)  # reaps it and closes its pipes
    wait_until(lambda: status(service.endpoint)["remote_send_bytes"] == 0, "its copies let go")
