"""Remote trainers through a network that misbehaves: resets, stalls, latency, a bandwidth cap.

Every test puts ``testkit.netfaults.FaultProxy`` (a real TCP proxy) between a trainer and a
service that listens on TCP with CURVE. The trainers that matter most run as another host would: in
their own mount namespace with a private /dev/shm, so every byte they get came through the proxy.
Run them all with ``pytest tests/integration -k network``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.tools.keys import make_keys
from testkit.netfaults import FaultProxy
from tests.helpers import (
    PRIVATE_SHM,
    REPO,
    ServiceFactory,
    ServiceProcess,
    free_port,
    private_shm_available,
    status,
    wait_until,
)

pytestmark = pytest.mark.integration

BATCH = 8
EPOCHS = 3
HEARTBEAT = 0.25
CLIENT_TIMEOUT = 4.0
"""Above the 2 s stall that must keep its session; short, so a bye lost in a reset costs little."""
REMOTE_TRAINER = """
import hashlib, json, os, sys
from gpu_worker import ServiceLoader
endpoint, server_key, client_key, mode, epochs = sys.argv[1:6]
assert not [n for n in os.listdir("/dev/shm") if n.startswith("dataferry-")], "not a private /dev/shm"
kwargs = {"mode": "broadcast", "group": "net", "group_size": 2} if mode == "broadcast" else {}
with ServiceLoader(endpoint, server_key=server_key, client_key=client_key, timeout=60, **kwargs) as loader:
    out = {"transport": loader.transport, "epochs": []}
    for _ in range(int(epochs)):
        seen = []
        for batch in loader:
            for row, index in enumerate(batch.indices.tolist()):
                seen.append([index, hashlib.sha1(batch.images[row].numpy().tobytes()).hexdigest()])
        out["epochs"].append(seen)
print(json.dumps(out))
"""


class Net:
    """A CURVE service on a TCP port, and a fault proxy in front of it."""

    def __init__(self, root: Path, start_service: ServiceFactory, photos: Path, **flags: object) -> None:
        self.service_keys = make_keys(root / "service", "service")
        self.trainer_keys = make_keys(root / "trainer", "trainer")
        authorized = root / "authorized"
        authorized.mkdir()
        (authorized / "trainer.key").write_bytes(self.trainer_keys.public.read_bytes())
        self.port = free_port()
        self.service: ServiceProcess = start_service(
            photos,
            endpoint=f"tcp://127.0.0.1:{self.port}",
            batch_size=BATCH,
            heartbeat_interval=HEARTBEAT,
            curve_secret_key=self.service_keys.secret,
            curve_authorized=authorized,
            **flags,
        )
        self.proxy = FaultProxy(("127.0.0.1", self.port)).start()

    def keys(self) -> dict[str, Any]:
        return {"server_key": str(self.service_keys.public), "client_key": str(self.trainer_keys.secret)}

    def loader(self, *, direct: bool = False, **kwargs: Any) -> ServiceLoader:
        endpoint = f"tcp://127.0.0.1:{self.port}" if direct else self.proxy.endpoint
        return ServiceLoader(endpoint, timeout=60, **self.keys(), **kwargs)

    def remote_trainer(self, mode: str, epochs: int = EPOCHS) -> subprocess.Popen[str]:
        """A trainer "on another host": its own /dev/shm, every byte through the proxy."""
        keys = self.keys()
        isolate = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM]
        trainer = [sys.executable, "-c", REMOTE_TRAINER, self.proxy.endpoint]
        return subprocess.Popen(
            [*isolate, *trainer, keys["server_key"], keys["client_key"], mode, str(epochs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def status(self) -> dict[str, Any]:
        return status(f"tcp://127.0.0.1:{self.port}", **self.keys())


@pytest.fixture
def net(tmp_path: Path, start_service: ServiceFactory, photos: Path) -> Iterator[Net]:
    network = Net(tmp_path / "keys", start_service, photos, client_timeout=CLIENT_TIMEOUT)
    try:
        yield network
    finally:
        network.proxy.close()


needs_private_shm = pytest.mark.skipif(
    not private_shm_available(), reason="unshare --mount needs root or user namespaces here"
)


def finish(proc: subprocess.Popen[str], timeout: float = 150) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the remote trainer hung:\n{err[-4000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    result: dict[str, Any] = json.loads(out)
    return result


def epochs_of(loader: ServiceLoader, epochs: int = EPOCHS) -> list[list[list[Any]]]:
    """What a trainer saw: per epoch, [index, pixel digest] in delivery order."""
    out = []
    for _ in range(epochs):
        seen = []
        for batch in loader:
            for row, index in enumerate(batch.indices.tolist()):
                seen.append([index, hashlib.sha1(batch.images[row].numpy().tobytes()).hexdigest()])
        out.append(seen)
    return out


def assert_exactly_once(epochs: list[list[list[Any]]], reference: list[list[list[Any]]], n: int) -> None:
    for e, (seen, expected) in enumerate(zip(epochs, reference, strict=True)):
        indices = sorted(index for index, _ in seen)
        assert indices == list(range(n)), f"epoch {e}: not every image exactly once"
        assert seen == expected, f"epoch {e}: other samples, order or pixels than without faults"


# --- resets -----------------------------------------------------------------------------------


@needs_private_shm
def test_resets_every_few_batches_lose_and_double_nothing_in_shard_mode(net: Net, photos: Path) -> None:
    n = len(build_index(photos))
    with net.loader(direct=True) as local:
        reference = epochs_of(local)
    net.proxy.faults.reset_every = 2 * BATCH * 3 * 32 * 32  # about every two batches
    got = finish(net.remote_trainer("shard"))
    assert got["transport"] == "tcp"
    assert net.proxy.counters.resets >= 5, net.proxy.counters
    assert_exactly_once(got["epochs"], reference, n)
    assert_no_credit_leaked(net)


@needs_private_shm
def test_resets_every_few_batches_lose_and_double_nothing_in_a_broadcast_group(
    net: Net, photos: Path
) -> None:
    """Both members of a group of two are remote, and every reset hits both."""
    n = len(build_index(photos))
    net.proxy.faults.reset_every = 3 * BATCH * 3 * 32 * 32
    members = [net.remote_trainer("broadcast"), net.remote_trainer("broadcast")]
    first, second = (finish(proc) for proc in members)
    assert net.proxy.counters.resets >= 5, net.proxy.counters
    for e in range(EPOCHS):
        assert sorted(i for i, _ in first["epochs"][e]) == list(range(n)), f"epoch {e}"
        assert first["epochs"][e] == second["epochs"][e], f"epoch {e}: members saw different batches"
    assert_no_credit_leaked(net)


def assert_no_credit_leaked(net: Net) -> None:
    """Once the trainers' sessions are gone (a bye, or the client timeout where a reset took the
    bye too), no slot is left leased: the resends and recovered releases kept the books right."""
    wait_until(lambda: net.status()["attached"] == 0, "every session gone", timeout=CLIENT_TIMEOUT + 10)
    slots = net.status()["feeds"][0]["slots"]
    assert slots["leased"] == 0, slots


def test_a_reset_with_every_credit_in_flight_is_recovered_not_timed_out(net: Net, photos: Path) -> None:
    """The issue's case: all announced batches die with the connection; before acknowledgements the
    service counted them leased forever and the trainer timed out."""
    n = len(build_index(photos))
    with net.loader(transport="tcp", credits=4) as loader:
        net.proxy.faults.hold_from_server = True  # what the service sends stays in flight
        seen: list[int] = []
        trainer = threading.Thread(target=lambda: seen.extend(i for b in loader for i in b.indices.tolist()))
        trainer.start()
        try:
            wait_until(lambda: net.status()["sessions"][0]["leased"] == 4, "every credit announced")
            net.proxy.reset()  # and lost
            net.proxy.faults.hold_from_server = False
        finally:
            trainer.join(60)
        body = net.status()
    assert sorted(seen) == list(range(n))
    session = body["sessions"][0]
    assert session["resent"] >= 4, "the lost announcements were sent again"


# --- stalls -----------------------------------------------------------------------------------


def stalled_epoch(
    net: Net, stall: float, **kwargs: Any
) -> tuple[list[list[list[Any]]], list[list[list[Any]]]]:
    """One epoch through the proxy with one stall of ``stall`` seconds after the third batch, and
    the same epoch read directly as the reference."""
    with net.loader(direct=True, transport="tcp") as direct:
        reference = epochs_of(direct, 1)
    net.proxy.faults.stall_at = [(3 * BATCH * 3 * 32 * 32, stall)]
    with net.loader(transport="tcp", **kwargs) as loader:
        got = epochs_of(loader, 1)
    assert net.proxy.counters.stalls == 1, "the stall happened"
    return got, reference


def test_a_two_second_stall_costs_nothing_but_time(net: Net, photos: Path) -> None:
    got, reference = stalled_epoch(net, 2.0)
    assert_exactly_once(got, reference, len(build_index(photos)))
    assert net.service.log.count("attached to feed") == 2, "one session each: it lived through the stall"
    assert "no heartbeat" not in net.service.log


def test_a_stall_longer_than_the_client_timeout_continues_the_epoch_where_the_trainer_was(
    tmp_path: Path, start_service: ServiceFactory, photos: Path
) -> None:
    """The service gives the session up (no heartbeat for the client timeout); the trainer opens a
    new one and starts the epoch again at its position: still every image once."""
    net = Net(tmp_path / "keys", start_service, photos, client_timeout=1.5)
    try:
        got, reference = stalled_epoch(net, 4.0)
    finally:
        net.proxy.close()
    assert_exactly_once(got, reference, len(build_index(photos)))
    net.service.wait_for(r"detached: no heartbeat")


# --- a slow link ------------------------------------------------------------------------------


def test_a_slow_far_link_delivers_everything_in_order(net: Net, photos: Path) -> None:
    """50 ms each way and 100 MB/s: slower, never wrong. The throughput ratio is benchmark (l)."""
    with net.loader(direct=True, transport="tcp") as direct:
        reference = epochs_of(direct, 2)
    net.proxy.faults.latency = 0.05
    net.proxy.faults.bandwidth = 100e6
    with net.loader(transport="tcp") as loader:
        got = epochs_of(loader, 2)
    assert_exactly_once(got, reference, len(build_index(photos)))


def test_a_release_lost_with_its_connection_gives_its_credit_back(net: Net) -> None:
    """Before acknowledgements the service counted the lease forever: one credit less for good."""
    got1, go, got2 = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def trainer() -> None:
        it = iter(loader)
        first = next(it)
        seen.extend(first.indices.tolist())
        got1.set()
        assert go.wait(30)
        del first
        second = next(it)  # sends the first batch's release on the way
        seen.extend(second.indices.tolist())
        del second
        got2.set()
        assert go.wait(30)
        for batch in it:
            seen.extend(batch.indices.tolist())

    with net.loader(transport="tcp", credits=4) as loader:
        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            assert got1.wait(30)
            net.proxy.faults.hold_from_client = True
            go.set()
            assert got2.wait(30)
            # The trainer's first connection carries its releases; nothing else goes on it until the
            # next fetch, so what it sent since the hold began is the release.
            wait_until(lambda: net.proxy.held_from_clients()[0] > 0, "the release is in flight")
            net.proxy.reset()  # and lost
            net.proxy.faults.hold_from_client = False
        finally:
            go.set()
            thread.join(60)
        assert sorted(seen) == list(range(90))
        # Every credit is there again: the loop can hold all four it was granted. The lost release
        # would have cost one for good, and the fourth fetch would time out.
        it = iter(loader)
        held = [next(it) for _ in range(4)]
        assert len(held) == 4
        assert net.status()["sessions"][0]["recovered_releases"] >= 1
