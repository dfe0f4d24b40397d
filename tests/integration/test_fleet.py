"""One trainer fed by several services at once (NOTE [ A fleet ] in gpu_worker/fleet_pass.py).

As on several hosts: the TCP services each run in their own private /dev/shm and take only CURVE
clients, so every batch they give comes over the socket; one more service is local, on ipc. Real
processes and sockets; services are killed (SIGKILL) and frozen (SIGSTOP) for real.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import ServiceError, ServiceLoader
from gpu_worker.fleet import TURN
from gpu_worker.loader_config import MAX_ENDPOINTS
from loader_service.decode.decoders import roi_decoder_version
from loader_service.tools.keys import make_keys
from tests.helpers import REPO, ServiceFactory, ServiceProcess, free_port, private_shm_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not private_shm_available(), reason="unshare --mount needs root or user namespaces"),
]
HEARTBEAT = 0.25
Seen = list[tuple[int, list[int], str]]
"""Per batch: (seq in the epoch, sample indices, digest of its pixels)."""


class Fleet:
    """``tcp`` services behind CURVE in private /dev/shm, plus ``ipc`` local ones, same data and seed."""

    def __init__(self, root: Path, start_service: ServiceFactory, photos: Path) -> None:
        self.service_keys = make_keys(root / "service", "service")
        self.trainer_keys = make_keys(root / "trainer", "trainer")
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        (self.authorized / "trainer.key").write_bytes(self.trainer_keys.public.read_bytes())
        self._start = start_service
        self._photos = photos
        self.services: list[ServiceProcess] = []

    def add(self, *, local: bool = False, **flags: object) -> str:
        common: dict[str, Any] = {
            "workers": 1,
            "heartbeat_interval": HEARTBEAT,
            "client_timeout": 3.0,
            # the same keys for every service of the fleet, the local one too
            "curve_secret_key": self.service_keys.secret,
            "curve_authorized": self.authorized,
        }
        if local:
            service = self._start(self._photos, name=f"local{len(self.services)}", **common, **flags)
        else:
            endpoint = str(flags.pop("endpoint", "")) or f"tcp://127.0.0.1:{free_port()}"
            service = self._start(self._photos, endpoint=endpoint, private_shm=True, **common, **flags)
        self.services.append(service)
        return service.endpoint

    def keys(self) -> dict[str, str]:
        return {"server_key": str(self.service_keys.public), "client_key": str(self.trainer_keys.secret)}

    def loader(self, endpoints: list[str], **kwargs: Any) -> ServiceLoader:
        return ServiceLoader(endpoints, timeout=60, **self.keys(), **kwargs)


HOSTS = Path("/etc/hosts")


@pytest.fixture
def host_name() -> Iterator[tuple[str, Callable[[list[str]], None]]]:
    """A host name of this test's own and ``point(addresses)``, which makes it resolve to exactly
    those (none: unknown) through the system's resolver, as a DNS server answers for a Kubernetes
    headless Service. /etc/hosts is written in place and given back as it was."""
    if not os.access(HOSTS, os.W_OK):
        pytest.skip("/etc/hosts is not writable here: no name this test can control")
    name = f"dataferry-fleet-{os.getpid()}.test"
    original = HOSTS.read_text()

    def point(addresses: list[str]) -> None:
        HOSTS.write_text(original + "".join(f"{address} {name}\n" for address in addresses))

    try:
        yield name, point
    finally:
        HOSTS.write_text(original)


@pytest.fixture
def fleet(tmp_path: Path, start_service: ServiceFactory, photos: Path) -> Iterator[Fleet]:
    yield Fleet(tmp_path / "keys", start_service, photos)


def digest(images: Any) -> str:
    return hashlib.sha1(images.numpy().tobytes()).hexdigest()


def epoch(loader: ServiceLoader, stop_after: int | None = None) -> Seen:
    seen: Seen = []
    for batch in loader:
        seen.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen


def reference(fleet: Fleet, epochs: int, **flags: object) -> list[Seen]:
    """What one local service alone delivers for the same seed (and ``flags``)."""
    one = fleet.add(local=True, **flags)
    with fleet.loader([one]) as loader:
        return [epoch(loader) for _ in range(epochs)]


def test_three_services_deliver_what_one_would_batch_for_batch(fleet: Fleet) -> None:
    expected = reference(fleet, 2)
    endpoints = [fleet.add(), fleet.add(), fleet.services[0].endpoint]
    with fleet.loader(endpoints) as loader:
        got = [epoch(loader), epoch(loader)]
        stats = loader.stats()
    assert got == expected, "the same batches, in the same order, with the same pixels"
    for seen in got:
        indices = [i for _, batch, _ in seen for i in batch]
        assert sorted(indices) == list(range(90)), "every image exactly once per epoch"
    shares = {endpoint: share["batches"] for endpoint, share in stats["endpoints"].items()}
    assert sum(shares.values()) == 2 * len(expected[0])
    assert all(count > 0 for count in shares.values()), f"every service took a share: {shares}"


def test_a_killed_and_a_frozen_service_cost_only_time(fleet: Fleet) -> None:
    """Batches of 2 (45 an epoch) against 3 credits a service: when the two are lost after the
    loop's third batch, most of the epoch is not yet given out, so once the loop has taken what
    each had delivered, each is given batches it will never deliver, and those reach the loop from
    another service: asked of it as a backup while the loop waits, or assigned again when the loss
    is seen (3 s of silence). With batches of 8 (12 an epoch) a loaded machine's services had often
    delivered all of theirs before the loss, and nothing was left to take over."""
    expected = reference(fleet, 2, batch_size=2)
    killed, frozen = fleet.add(batch_size=2), fleet.add(batch_size=2)
    endpoints = [fleet.services[0].endpoint, killed, frozen]
    with fleet.loader(endpoints, credits=3) as loader:
        first: Seen = []
        for batch in loader:
            first.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
            if len(first) == 3:
                fleet.services[1].proc.send_signal(signal.SIGKILL)
                fleet.services[2].proc.send_signal(signal.SIGSTOP)
        fleet.services[2].proc.send_signal(signal.SIGCONT)
        second = epoch(loader)
        stats = loader.stats()
    assert [first, second] == expected, "exactly once, in order, the loop saw no error"
    assert stats["reassigned"] + stats["backups"] > 0, (
        f"the lost services' batches went to the others: {stats}"
    )
    assert stats["endpoints"][killed]["state"] == "reconnecting"


def test_a_service_that_answers_late_joins_the_pass_under_way(fleet: Fleet, photos: Path) -> None:
    expected = reference(fleet, 1)[0]
    port = free_port()
    late = f"tcp://127.0.0.1:{port}"
    with fleet.loader([fleet.services[0].endpoint, late], connect_timeout=2, credits=2) as loader:
        seen: Seen = []
        for batch in loader:
            seen.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
            if len(seen) == 2:
                fleet.add(endpoint=late)
                # its hello has waited in the trainer's socket all along: it attaches at once
                fleet.services[-1].wait_for(r"attached to feed")
        stats = loader.stats()
    assert seen == expected, "exactly once, in order"
    assert stats["endpoints"][late]["batches"] > 0, f"the late service took a share: {stats}"


def test_a_fleet_named_by_a_host_follows_its_addresses_mid_epoch(
    fleet: Fleet, host_name: tuple[str, Callable[[list[str]], None]]
) -> None:
    """NOTE [ A fleet from a name ]: three services on 127.0.0.2-4, one port, one name. The name
    gains .4 and loses .2 while an epoch runs; the next epoch runs while it resolves to nothing."""
    name, point = host_name
    one = fleet.add(local=True, batch_size=4)
    with fleet.loader([one]) as loader:
        expected = [epoch(loader), epoch(loader)]
    port = free_port()
    gone, kept, joins = (fleet.add(endpoint=f"tcp://127.0.0.{k}:{port}", batch_size=4) for k in (2, 3, 4))
    point(["127.0.0.2", "127.0.0.3"])
    with fleet.loader([f"tcp://{name}:{port}"], resolve_interval=0.2, credits=2) as loader:
        assert set(loader.stats()["endpoints"]) == {gone, kept}, "both addresses of the name, at once"
        first: Seen = []
        for batch in loader:
            first.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
            if len(first) == 3:
                point(["127.0.0.3", "127.0.0.4"])
            if len(first) > 3:
                time.sleep(0.1)  # a training step: the epoch lasts while the name changes
        during = loader.stats()["endpoints"]
        point([])
        second = epoch(loader)
        after = loader.stats()["endpoints"]
    assert [first, second] == expected, "exactly once, in order, the same pixels, both epochs"
    assert gone not in during, f"the address the name lost left the fleet: {during}"
    assert during[joins]["batches"] > 0, f"the address the name gained served the epoch: {during}"
    assert set(after) == {kept, joins} and all(s["state"] == "attached" for s in after.values()), (
        f"a name that cannot be resolved keeps the addresses it had: {after}"
    )


REAL = ["127.0.0.200", "127.0.0.201"]
SILENT = [f"127.0.0.{k}" for k in range(2, 64)]
"""62 addresses below ``REAL`` where no service answers: nothing listens on most of them, a socket
that never speaks on a few (``mute``)."""


@contextlib.contextmanager
def mute(addresses: list[str], port: int) -> Iterator[None]:
    """A TCP socket listening on each address that takes connections and never says a word."""
    with contextlib.ExitStack() as stack:
        for address in addresses:
            listener = stack.enter_context(socket.socket())
            listener.bind((address, port))
            listener.listen(64)
        yield


def timed_epoch(
    loader: ServiceLoader, at: int = -1, change: Callable[[], None] = lambda: None
) -> tuple[Seen, float]:
    """One epoch with a 50 ms step a batch, ``change()`` after the ``at``-th; and the longest the
    loop waited for a batch."""
    seen: Seen = []
    longest = 0.0
    pulled = time.monotonic()
    for batch in loader:
        longest = max(longest, time.monotonic() - pulled)
        seen.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
        if len(seen) == at:
            change()
        time.sleep(0.05)
        pulled = time.monotonic()
    return seen, longest


def train_until(loader: ServiceLoader, done: Callable[[dict[str, Any]], bool], limit: float = 15.0) -> float:
    """Train (a 20 ms step a batch, epoch after epoch) until ``done(loader.stats()["endpoints"])``;
    the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        for _ in loader:
            time.sleep(0.02)
            if done(loader.stats()["endpoints"]):
                return time.monotonic() - began
    raise AssertionError(f"not within {limit:.0f} s: {loader.stats()['endpoints']}")


def test_silent_addresses_of_a_name_never_hold_up_the_loop(
    fleet: Fleet, host_name: tuple[str, Callable[[list[str]], None]]
) -> None:
    """NOTE [ A fleet from a name ]: a name gives 62 silent addresses beside two services. The
    attach waits for the services, not the silent ones; a batch never waits while the silent ones
    leave; and the loader closes at once with them back in the fleet. (Before: the attach took the
    whole connect timeout, one batch waited 31 s and ``close()`` 31 s, 0.5 s for each silent
    address.)"""
    name, point = host_name
    one = fleet.add(local=True, batch_size=4)
    with fleet.loader([one]) as loader:
        expected = [epoch(loader), epoch(loader)]
    port = free_port()
    for address in REAL:
        fleet.add(endpoint=f"tcp://{address}:{port}", batch_size=4)
    with mute(SILENT[::16], port):
        point(SILENT + REAL)
        began = time.monotonic()
        loader = fleet.loader([f"tcp://{name}:{port}"], resolve_interval=0.2, connect_timeout=10, credits=2)
        try:
            attach = time.monotonic() - began
            first, longest = timed_epoch(loader, at=3, change=lambda: point(REAL))
            point(SILENT + REAL)
            second, _ = timed_epoch(loader)
            placed = loader.stats()["endpoints"]
        finally:
            began = time.monotonic()
            loader.close()
            closing = time.monotonic() - began
    assert [first, second] == expected, "exactly once, in order, the same pixels, both epochs"
    assert len(placed) == len(SILENT) + len(REAL), f"the silent addresses were back when it closed: {placed}"
    figures = f"attach {attach:.1f} s, longest wait for a batch {longest:.1f} s, close {closing:.1f} s"
    assert attach < 3 and longest < 2 and closing < 2, figures


def test_silent_addresses_that_sort_first_do_not_hide_the_fleet(
    fleet: Fleet, host_name: tuple[str, Callable[[list[str]], None]]
) -> None:
    """More silent addresses below the one service than a fleet has places (``MAX_ENDPOINTS``):
    addresses take turns until they answer, so the service is found and serves the epoch. (Before:
    only the lowest 64 addresses were used, all silent: no service answered.)"""
    name, point = host_name
    port = free_port()
    fleet.add(endpoint=f"tcp://127.0.0.200:{port}")
    silent = [f"127.0.0.{k}" for k in range(2, 2 + MAX_ENDPOINTS + 6)]
    point([*silent, "127.0.0.200"])
    began = time.monotonic()
    with fleet.loader([f"tcp://{name}:{port}"], resolve_interval=0.2, connect_timeout=15) as loader:
        attach = time.monotonic() - began
        seen = epoch(loader)
    assert {i for _, batch, _ in seen for i in batch} == set(range(90)), "every image of the epoch"
    assert attach < TURN + 2.5, f"found after one turn of the silent addresses, not {attach:.1f} s"


def test_a_refused_address_leaves_with_its_name_and_is_tried_again_when_it_comes_back(
    fleet: Fleet, host_name: tuple[str, Callable[[list[str]], None]]
) -> None:
    """An address that serves another feed is left out; it leaves when the name no longer gives
    it, and when the name gives it again it is tried afresh: now serving the fleet's feed, it is
    taken in, and serves. (Before: it stayed left out for good, its address never tried again.)"""
    name, point = host_name
    port = free_port()
    fleet.add(endpoint=f"tcp://127.0.0.2:{port}")
    other = fleet.add(endpoint=f"tcp://127.0.0.3:{port}", seed=1)
    point(["127.0.0.2"])
    with fleet.loader([f"tcp://{name}:{port}"], resolve_interval=0.2) as loader:
        point(["127.0.0.2", "127.0.0.3"])
        train_until(loader, lambda endpoints: endpoints.get(other, {}).get("state") == "left out")
        point(["127.0.0.2"])
        train_until(loader, lambda endpoints: other not in endpoints)
        fleet.services[-1].stop()
        fleet.add(endpoint=other)  # the same address, now with the fleet's seed
        point(["127.0.0.2", "127.0.0.3"])
        train_until(loader, lambda endpoints: endpoints.get(other, {}).get("state") == "attached")
        point(["127.0.0.3"])  # the name's only address now: it serves every batch
        train_until(loader, lambda endpoints: endpoints.get(other, {}).get("batches", 0) > 0)
        assert loader.stats()["endpoints"][other]["state"] == "attached"


def test_a_checkpoint_taken_with_three_services_resumes_on_two(fleet: Fleet) -> None:
    expected = reference(fleet, 1)[0]
    endpoints = [fleet.services[0].endpoint, fleet.add(), fleet.add()]
    with fleet.loader(endpoints) as loader:
        before: Seen = []
        for batch in loader:
            before.append((batch.seq, batch.indices.tolist(), digest(batch.images)))
            if len(before) == 5:
                state = loader.state_dict()  # taken after the step, as a trainer would
                break
    assert state["consumed"] == 5 * 8, "five batches of 8 of one rank"
    with fleet.loader(endpoints[1:]) as loader:
        loader.load_state_dict(json.loads(json.dumps(state)))
        after = epoch(loader)
    assert before + after == expected, "exactly once across both runs, the same batches"


@pytest.mark.parametrize("order", ["same first", "other first"])
def test_a_service_with_another_seed_is_refused_naming_the_difference(fleet: Fleet, order: str) -> None:
    """The first endpoint given sets the feed, whichever service answers first."""
    same, other = fleet.add(), fleet.add(seed=1)
    endpoints = [same, other] if order == "same first" else [other, same]
    with pytest.raises(ServiceError) as refused:
        fleet.loader(endpoints, connect_timeout=20)
    message = str(refused.value)
    named, expected = (other, "seed 1, not 0") if order == "same first" else (same, "seed 0, not 1")
    assert message.startswith(named) and expected in message


def test_services_that_would_make_other_pixels_or_skip_other_files_are_refused(fleet: Fleet) -> None:
    """Alike in data, seed, transform and fields, but not in the resize filter, the file limits or
    the decoder's DCT scaling (a train feed with a sample cache decodes without it): each would
    deliver other pixels, or other samples, for the batches it decodes, so each is refused with
    what differs named."""
    reference = fleet.add()
    area = fleet.add(interpolation="area")
    small_files = fleet.add(max_file_bytes=100_000, max_pixels=1_000_000)
    others = [area, small_files]
    if roi_decoder_version() is not None:  # without the region decoder nothing is DCT-scaled anyway
        others.append(fleet.add(cache_memory="4M"))
    with pytest.raises(ServiceError) as refused:
        fleet.loader([reference, *others], connect_timeout=20)
    message = str(refused.value)
    assert (
        f"{area} serves another feed" in message
        and "interpolation 'area', not 'bilinear-antialias'" in message
    )
    assert f"{small_files} serves another feed" in message
    assert "max-file-bytes '100000', not '268435456'" in message and "max-pixels '1000000'" in message
    if len(others) == 3:
        assert f"{others[2]} serves another feed" in message and "dct-scaling 'off', not 'on'" in message
    with fleet.loader([reference, fleet.add()], connect_timeout=20) as loader:
        assert len(loader) > 0, "two services alike in all of it make a fleet"


RANK_SCRIPT = """
import json, os, sys
from gpu_worker import ServiceLoader
endpoints, server_key, client_key = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
with ServiceLoader(endpoints, server_key=server_key, client_key=client_key, timeout=60) as loader:
    out = [[int(i) for batch in loader for i in batch.indices.tolist()] for _ in range(2)]
    counts = [len(loader)]
print(json.dumps({"rank": int(os.environ["RANK"]), "epochs": out, "batches": counts}))
"""


def test_torchrun_two_ranks_over_a_fleet_of_two(fleet: Fleet, tmp_path: Path) -> None:
    endpoints = [fleet.add(), fleet.add()]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    keys = fleet.keys()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--tee",
            "1",
            str(script),
            ",".join(endpoints),
            keys["server_key"],
            keys["client_key"],
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads(line.split("]:", 1)[-1]) for line in run.stdout.splitlines() if '"rank"' in line]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert ranks[0]["batches"] == ranks[1]["batches"], "equal batch counts (DDP never hangs)"
    for e in range(2):
        indices = ranks[0]["epochs"][e] + ranks[1]["epochs"][e]
        assert sorted(indices) == list(range(90)), "each image once across ranks"
