"""The service restarts under running trainers: they reconnect and continue where they were."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_worker import ServiceLoader, ServiceTimeout
from loader_service.dataset.index import build_index
from tests.helpers import ServiceFactory, consume_with_pause, in_background, our_segments

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("how", "source"),
    [
        (signal.SIGTERM, "imagefolder"),
        (signal.SIGKILL, "imagefolder"),
        (signal.SIGKILL, "tar"),
        (signal.SIGTERM, "jsonl"),
    ],
)
def test_trainer_continues_its_epoch_across_a_service_restart(
    photo_sources: dict[str, Path], start_service: ServiceFactory, how: int, source: str
) -> None:
    photos = photo_sources[source]
    n = len(build_index(photo_sources["imagefolder"]))
    first = start_service(photos, batch_size=8, name="svc")
    segment = first.wait_for(r"\((dataferry-[^)]+)\)").group(1)
    paused, go = threading.Event(), threading.Event()

    def trainer() -> tuple[list[int], int]:
        with ServiceLoader(first.endpoint, timeout=30) as loader:
            seen = consume_with_pause(loader, 4, paused, go)
            return seen, sum(len(b.indices) for b in loader)

    with in_background(trainer, "the trainer") as outcome:
        try:
            assert paused.wait(60)
            if how == signal.SIGKILL:
                first.kill_group()
                assert segment in our_segments(), "a killed service cannot clean up"
            else:
                assert first.stop(how) == 0
            second = start_service(photos, batch_size=8, name="svc")
            if how == signal.SIGKILL:
                # Removed by the next start on the host: this one, or another test's running beside it.
                assert segment not in our_segments(), "what the killed service left is gone"
        finally:
            go.set()
        seen, following = outcome.result(90)
    assert sorted(seen) == list(range(n)), "each image of the epoch exactly once across the restart"
    assert following == n, "and the next epoch is whole"
    second.wait_for(r"attached to feed 'train'")


def test_service_gone_longer_than_timeout_is_a_clear_error(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=8)
    with ServiceLoader(service.endpoint, timeout=4) as loader:
        it = iter(loader)
        next(it)
        service.stop()
        started = time.monotonic()
        with pytest.raises(
            ServiceTimeout, match=rf"no batch within 4 s: {service.endpoint} silent for [45] s"
        ):
            for _ in it:
                pass
        assert time.monotonic() - started < 15


def test_a_trainer_that_lost_touch_with_a_live_service_takes_its_session_back(
    photos: Path, start_service: ServiceFactory
) -> None:
    """The service stops answering for longer than the trainer waits (SIGSTOP), then comes back:
    the trainer resumes its session, the batch it holds keeps its slot, and the epoch is whole."""
    n = len(build_index(photos))
    client_timeout = 8.0
    service = start_service(photos, batch_size=8, slots=6, client_timeout=client_timeout)
    with ServiceLoader(service.endpoint, timeout=60) as loader:
        it = iter(loader)
        held = next(it)
        copy = held.images.clone()
        seen = held.indices.tolist()
        service.proc.send_signal(signal.SIGSTOP)
        resumer = threading.Timer(7.0, service.proc.send_signal, args=(signal.SIGCONT,))
        resumer.start()  # the trainer gives the session up after 5 silent heartbeats
        try:
            seen += [i for batch in it for i in batch.indices.tolist()]
        finally:
            resumer.join()
            service.proc.send_signal(signal.SIGCONT)
        assert sorted(seen) == list(range(n)), "each image once across the reconnect"
        # Had the trainer opened a new session instead, the old one (holding ``held``'s slot) would
        # expire within client_timeout and the slot would be refilled by the epochs below.
        until = time.monotonic() + client_timeout + 2
        while time.monotonic() < until:
            assert sum(len(b.indices) for b in loader) == n
        assert torch.equal(held.images, copy), "the held batch kept its slot through the reconnect"
    service.wait_for(r"session \w+ \(\S+\) resumed on a new connection")
    assert "no heartbeat" not in service.log


def test_a_trainer_that_waits_out_a_long_restart_gets_one_session_and_its_whole_epoch(
    photos: Path, start_service: ServiceFactory
) -> None:
    """While the service is down the trainer sends its resuming hello again every few seconds and
    ZeroMQ queues them all; the restarted service welcomes the repeats instead of opening a session
    for each (each used to replace the last, and the trainer, holding the first one's token, was
    refused until it timed out)."""
    n = len(build_index(photos))
    first = start_service(photos, batch_size=8, name="svc", heartbeat_interval=0.2)
    three = threading.Event()

    def trainer() -> list[int]:
        with ServiceLoader(first.endpoint, timeout=60) as loader:
            seen: list[int] = []
            for batch in loader:
                seen += batch.indices.tolist()
                if len(seen) >= 3 * 8:
                    three.set()
            return seen

    with in_background(trainer, "the trainer") as outcome:
        assert three.wait(60)
        assert first.stop() == 0
        time.sleep(8)  # the outage itself: the trainer gives the session up after 3 s, then waits
        second = start_service(photos, batch_size=8, name="svc", heartbeat_interval=0.2)
        seen = outcome.result(90)
    assert sorted(seen) == list(range(n)), "each image of the epoch exactly once"
    assert second.log.count("attached to feed") == 1, "one session for all the repeated hellos"
