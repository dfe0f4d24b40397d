"""The service's Prometheus endpoint, scraped over HTTP while a trainer runs."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from tests.helpers import ServiceFactory, free_port

pytestmark = pytest.mark.integration


def sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name)]
    assert lines, f"{name} not exposed:\n{text}"
    return float(lines[0].rsplit(" ", 1)[1])


def test_every_leased_batch_records_how_long_it_waited_ready(
    photos: Path, start_service: ServiceFactory
) -> None:
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, batch_size=8, metrics_port=port)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        batches = sum(1 for _ in loader)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert sample(text, 'dataferry_batch_ready_wait_seconds_count{feed="train"}') == batches
    assert sample(text, 'dataferry_batch_ready_wait_seconds_sum{feed="train"}') >= 0


def train_for(loader: ServiceLoader, seconds: float, step: float) -> None:
    """Epochs of a loop whose step takes ``step`` seconds, until ``seconds`` have passed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in loader:
            time.sleep(step)  # the training step: the loop computes, it does not wait for data
            if time.monotonic() >= end:
                break


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


@pytest.mark.parametrize(
    ("step", "bound"),
    [(0.0, "data"), (0.25, "trainer")],
)
def test_the_load_follows_what_the_trainer_waits_for(
    photos: Path, start_service: ServiceFactory, step: float, bound: str
) -> None:
    """NOTE [ Fleet load ]: a loop that only pulls waits on one decode worker, which is always busy:
    the load asks for more services. A loop whose step is slower than decoding never waits and the
    worker idles: the load says fewer would do, however busy it was a moment before."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    service = start_service(photos, workers=1, batch_size=8, metrics_port=port, heartbeat_interval=0.25)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        train_for(loader, 4.0, step)
        stats = loader.stats()
        text = scrape(port)
    names = ("dataferry_load ", "dataferry_decode_busy ", "dataferry_demand ")
    load, busy, demand = (sample(text, name) for name in names)
    waited_share = stats["waited_s"] / (stats["waited_s"] + stats["computed_s"])
    if bound == "data":
        assert waited_share > 0.5, f"the loop itself saw that it waited: {stats}"
        assert demand > 2 and busy > 0.6 and load > 1.5, f"more services asked for: {text}"
    else:
        assert waited_share < 0.2, f"the loop itself saw that it computed: {stats}"
        assert demand < 1.3 and busy < 0.5 and load < 0.6, f"fewer services would do: {text}"
    assert load == pytest.approx(busy * demand, abs=0.01)
