"""The main-loop benchmark's write-nothing workers, and the benchmark itself at a tiny size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import loop_cost
from gpu_worker import ServiceLoader
from loader_service.dataset.sampler import shard_order
from loader_service.decode.contract import BENCH_WRITE_NOTHING_ENV
from tests.helpers import ServiceFactory

pytestmark = pytest.mark.integration


def test_write_nothing_workers_deliver_the_planned_samples_without_reading_them(
    tmp_path: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None of the listed files exists: a worker that read them would report every sample bad."""
    data = loop_cost.write_list(tmp_path / "missing.csv", 50)
    monkeypatch.setenv(BENCH_WRITE_NOTHING_ENV, "1")
    service = start_service(data, batch_size=8)
    service.wait_for(rf"{BENCH_WRITE_NOTHING_ENV}=1: decode workers write nothing")
    order = shard_order(0, 0, 50, 0, 1, "pad")
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        got = [(batch.seq, batch.indices.tolist()) for batch in loader]
    assert got == [(seq, order.batch(seq, 8).tolist()) for seq in range(7)]


def test_the_benchmark_reports_batches_and_cpu(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    argv = ["--samples", "500", "--modes", "shard", "--trainers", "2", "--seconds", "1", "--warmup", "0.2"]
    assert loop_cost.main([*argv, "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["trainers"] == 2 and run["samples"] == 500
    assert run["deliveries"] > 0 and run["decoded"] > 0
    assert 0 < run["main_cpu"] <= run["process_cpu"]
    assert run["rss_mib"] > 0
    assert run["sustainable_batches_per_second"] > 0
