"""Trainers on other hosts: batches over TCP with CURVE, a trainer that cannot see /dev/shm, intruders.

"Another host" is a trainer process in its own mount namespace with a fresh tmpfs on /dev/shm: it
truly cannot open the service's segments, so everything it gets came over the socket.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceLoader, ServiceTimeout
from loader_service.dataset.index import build_index
from loader_service.tools.keys import KeyPair, make_keys
from tests.helpers import (
    PRIVATE_SHM,
    REPO,
    ServiceFactory,
    consume_with_pause,
    free_port,
    in_background,
    in_threads,
    private_shm_available,
    status,
)

pytestmark = pytest.mark.integration

EPOCH_DIGESTS = """
import hashlib, json, os, sys
from gpu_worker import ServiceLoader
endpoint, server_key, client_key = sys.argv[1:4]
assert not [n for n in os.listdir("/dev/shm") if n.startswith("dataferry-")], "not a private /dev/shm"
with ServiceLoader(endpoint, server_key=server_key, client_key=client_key, timeout=60) as loader:
    out = {"transport": loader.transport, "samples": {}}
    for batch in loader:
        for row, index in enumerate(batch.indices.tolist()):
            out["samples"].setdefault(str(index), []).append(
                hashlib.sha1(batch.images[row].numpy().tobytes()).hexdigest()
            )
print(json.dumps(out))
"""


class Keys:
    def __init__(self, root: Path) -> None:
        self.service = make_keys(root / "service", "service")
        self.trainer = make_keys(root / "trainer", "trainer")
        self.stranger = make_keys(root / "stranger", "stranger")
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        shutil.copy(self.trainer.public, self.authorized / "trainer.key")

    def flags(self) -> dict[str, object]:
        return {"curve_secret_key": self.service.secret, "curve_authorized": self.authorized}

    def of(self, pair: KeyPair) -> dict[str, Any]:
        return {"server_key": str(self.service.public), "client_key": str(pair.secret)}


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys")


def digests(loader: ServiceLoader) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for batch in loader:
        for row, index in enumerate(batch.indices.tolist()):
            seen.setdefault(str(index), []).append(
                hashlib.sha1(batch.images[row].numpy().tobytes()).hexdigest()
            )
    return seen


def test_a_trainer_without_the_segment_gets_every_image_once_over_tcp_with_the_same_pixels(
    photos: Path, start_service: ServiceFactory, keys: Keys
) -> None:
    if not private_shm_available():
        pytest.skip(
            "cannot give a trainer its own /dev/shm here (unshare --mount needs root or user namespaces)"
        )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = start_service(photos, endpoint=endpoint, batch_size=8, **keys.flags())
    remote = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            PRIVATE_SHM,
            sys.executable,
            "-c",
            EPOCH_DIGESTS,
            endpoint,
            str(keys.service.public),
            str(keys.trainer.secret),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert remote.returncode == 0, remote.stderr
    got = json.loads(remote.stdout)
    assert got["transport"] == "tcp"
    with ServiceLoader(service.endpoint, timeout=60, **keys.of(keys.trainer)) as local:
        assert local.transport == "shm", "on the service's host the segment is mapped"
        reference = digests(local)
    n = len(build_index(photos))
    assert sorted(map(int, got["samples"])) == list(range(n)), "every image, each once"
    assert all(len(hashes) == 1 for hashes in got["samples"].values())
    assert got["samples"] == reference, "the same pixels as the local trainer's"


def test_local_and_remote_members_share_one_broadcast_group(
    photos: Path, start_service: ServiceFactory, keys: Keys
) -> None:
    service = start_service(photos, endpoint=f"tcp://127.0.0.1:{free_port()}", batch_size=8, **keys.flags())

    def member(transport: str) -> dict[str, list[str]]:
        with ServiceLoader(
            service.endpoint,
            mode="broadcast",
            group="mixed",
            group_size=2,
            transport=transport,
            timeout=60,
            **keys.of(keys.trainer),
        ) as loader:
            assert loader.transport == transport
            return digests(loader)

    local, remote = in_threads([lambda: member("shm"), lambda: member("tcp")])
    assert local == remote and len(local) == len(build_index(photos))
    feed = status(service.endpoint, **keys.of(keys.trainer))["feeds"][0]
    assert feed["decoded"] - feed["warm_decoded"] == len(local), "decoded once for both members"


def test_peers_without_an_authorised_key_get_nothing(
    photos: Path, start_service: ServiceFactory, keys: Keys
) -> None:
    service = start_service(photos, endpoint=f"tcp://127.0.0.1:{free_port()}", **keys.flags())
    with pytest.raises(ServiceTimeout):
        ServiceLoader(service.endpoint, connect_timeout=2, **keys.of(keys.stranger))
    with pytest.raises(ServiceTimeout):
        ServiceLoader(service.endpoint, connect_timeout=2)  # no CURVE at all
    service.wait_for(r"refused a peer whose CURVE key is not authorised")
    assert status(service.endpoint, **keys.of(keys.trainer))["attached"] == 0
    # Authorising the key and sending SIGHUP lets it in, without a restart.
    shutil.copy(keys.stranger.public, keys.authorized / "stranger.key")
    service.proc.send_signal(1)
    service.wait_for(r"CURVE: 2 trainer keys allowed")
    with ServiceLoader(service.endpoint, connect_timeout=10, **keys.of(keys.stranger)) as loader:
        assert next(iter(loader)).images.shape[0] > 0


def test_a_remote_trainer_continues_its_epoch_across_a_service_restart(
    photos: Path, start_service: ServiceFactory, keys: Keys
) -> None:
    """Reconnect and exactly-once hold over TCP as over ipc: the service is stopped mid-epoch and a
    new one starts on the same port; the trainer, holding nothing, continues where it was."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = start_service(photos, endpoint=endpoint, batch_size=8, **keys.flags())
    paused, go = threading.Event(), threading.Event()

    def trainer() -> list[int]:
        with ServiceLoader(endpoint, transport="tcp", timeout=30, **keys.of(keys.trainer)) as loader:
            return consume_with_pause(loader, 4, paused, go)

    with in_background(trainer, "the trainer") as outcome:
        try:
            assert paused.wait(60)
            assert first.stop() == 0
            start_service(photos, endpoint=endpoint, batch_size=8, **keys.flags())
        finally:
            go.set()
        seen = outcome.result(90)
    assert sorted(seen) == list(range(len(build_index(photos)))), "each image once across the restart"


def test_a_remote_trainer_stays_attached_through_a_long_step(
    photos: Path, start_service: ServiceFactory, keys: Keys
) -> None:
    """Its heartbeats pass CURVE too: a step longer than the client timeout costs it nothing."""
    service = start_service(
        photos, endpoint=f"tcp://127.0.0.1:{free_port()}", batch_size=8, client_timeout=2, **keys.flags()
    )
    with ServiceLoader(service.endpoint, transport="tcp", timeout=30, **keys.of(keys.trainer)) as loader:
        seen: list[int] = []
        for i, batch in enumerate(loader):
            seen += batch.indices.tolist()
            if i == 0:
                time.sleep(5)  # the long step itself, more than twice the client timeout
    assert sorted(seen) == list(range(len(build_index(photos))))
    assert "no heartbeat" not in service.log and "stopped reading" not in service.log
