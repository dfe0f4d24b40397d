"""The service's Prometheus endpoint, scraped over HTTP while a trainer runs."""

from __future__ import annotations

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
