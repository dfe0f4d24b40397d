"""A weighted job changes its weights mid-run (NOTE [ Weight changes ], NOTE [ Weightings ])
through a real service: from the first sample of the step it names, the very order the pure mixture
gives; resumed at other world sizes after the change, every position once; a broadcast group reads
a mixture, and refuses a member with other weights by name."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from gpu_worker import ServiceError, ServiceLoader
from loader_service.dataset.index import build_index
from loader_service.dataset.mixture import Mixture, integer_weights
from tests.helpers import ServiceFactory, free_port, in_background, in_threads, job_steps, status

if TYPE_CHECKING:
    from testkit.s3server import S3Server

pytestmark = pytest.mark.integration

NAMES = ("folder", "shards", "list")
KINDS = ("imagefolder", "tar", "csv")
BATCH, EPOCH = 8, 200
FIRST = {"folder": 0.2, "shards": 0.5, "list": 0.3}
THEN = {"folder": 0.7, "shards": 0.0, "list": 0.3}


def rows(batch: Any) -> list[tuple[int, int]]:
    return list(zip(batch.sources.tolist(), batch.indices.tolist(), strict=True))


def expected(sizes: list[int], seed: int, change: int) -> list[tuple[int, int]]:
    """Epoch 0 of the mixture, ``THEN`` from position ``change`` on: (source, sample) by position."""
    mixture = Mixture.of(sizes, seed, EPOCH, integer_weights(FIRST, NAMES))
    mixture = mixture.changed([(change, tuple(THEN.values()))], NAMES)
    numbers = mixture.epoch(0).at(np.arange(EPOCH))
    source = np.searchsorted(mixture.offsets, numbers, side="right") - 1
    return list(zip(source.tolist(), (numbers - mixture.offsets[source]).tolist(), strict=True))


@pytest.fixture
def mixed(photo_sources: dict[str, Path], start_service: ServiceFactory) -> tuple[Any, list[int]]:
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    sizes = [len(build_index(photo_sources[kind])) for kind in KINDS]
    return start_service(None, source=flags, batch_size=BATCH), sizes


def test_a_change_mid_pass_applies_from_the_first_sample_of_its_step(mixed: tuple[Any, list[int]]) -> None:
    """Three batches taken, then a change at batch 10: the whole epoch is the pure mixture's order
    with that change at position 80, batches decoded ahead with the old weights included. A step
    already taken cannot be changed, nor a loader without weights."""
    service, sizes = mixed
    got: list[tuple[int, int]] = []
    with ServiceLoader(service.endpoint, weights=FIRST, epoch_samples=EPOCH, timeout=60) as loader:
        for step, batch in enumerate(loader):
            got += rows(batch)
            if step == 2:
                loader.set_weights(THEN, at_batch=10)
                with pytest.raises(ValueError, match="already past"):
                    loader.set_weights(FIRST, at_batch=2)
                loader.set_weights(THEN, at_batch=10)  # the same change again: no change
        seed = loader.info.seed
    assert got == expected(sizes, seed, 10 * BATCH)
    assert sum(1 for s, _ in got[10 * BATCH :] if s == 1) == 0, "a weight of 0 after the change"
    with ServiceLoader(service.endpoint, timeout=60) as plain, pytest.raises(ValueError, match="weights="):
        plain.set_weights(THEN, at_batch=1)
    assert service.stop() == 0


def test_after_a_change_the_job_resumes_at_any_world_size_exactly_once(mixed: tuple[Any, list[int]]) -> None:
    """The change at position 96 (batch 6 of a 2-rank job): 2 ranks take 3 steps, 3 ranks resume
    from that state and take 3 more (past the change), 1 rank finishes: each position once, as the
    pure order has them. Neither later job calls set_weights: the state carries the change."""
    service, sizes = mixed
    weights = {"weights": FIRST, "epoch_samples": EPOCH}
    first, state = job_steps(service.endpoint, 2, 3, None, rows, change=(THEN, 6), **weights)
    assert state["weight_changes"] == [[96, list(THEN.values())]]
    second, state = job_steps(service.endpoint, 3, 3, state, rows, **weights)
    assert state["consumed"] == 48 + 72
    third, _ = job_steps(service.endpoint, 1, -1, state, rows, **weights)
    with ServiceLoader(service.endpoint, **weights, timeout=60) as one:
        seed = one.info.seed
    assert sorted(first + second + third) == sorted(expected(sizes, seed, 96))
    longer = ServiceLoader(service.endpoint, weights=FIRST, epoch_samples=EPOCH + 8, timeout=60)
    with longer, pytest.raises(ValueError, match="fingerprint"):
        longer.load_state_dict(state)  # another epoch length: another order
    assert service.stop() == 0


def test_a_broadcast_group_reads_a_mixture_and_refuses_other_weights(mixed: tuple[Any, list[int]]) -> None:
    service, sizes = mixed
    endpoint = service.endpoint
    member_args = {"mode": "broadcast", "group": "g", "group_size": 2, "timeout": 60}

    def member() -> list[tuple[int, int]]:
        with ServiceLoader(endpoint, weights=FIRST, epoch_samples=EPOCH, **member_args) as loader:
            got = [row for batch in loader for row in rows(batch)]
            with pytest.raises(ServiceError, match=r"broadcast group .g. reads weights folder 0\.2"):
                ServiceLoader(endpoint, weights=THEN, epoch_samples=EPOCH, connect_timeout=10, **member_args)
            return got

    one, two = in_threads([member] * 2)
    with ServiceLoader(endpoint, weights=FIRST, epoch_samples=EPOCH, timeout=60) as shard:
        seed = shard.info.seed
    assert one == two == expected(sizes, seed, EPOCH), "the group's one order, the mixture's"
    assert service.stop() == 0


def scraped_within(port: int, line: str, seconds: float) -> bool:
    """Whether ``line`` appears on the metrics page within ``seconds`` (it is refreshed each second)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            if line in reply.read().decode().splitlines():
                return True
        time.sleep(0.2)  # polling a page refreshed once a second: there is no event to wait on
    return False


def test_status_metrics_and_stats_show_where_a_job_stands_in_each_source(
    photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """NOTE [ Source ledger ]: after a whole epoch, the trainer's ``stats()``, the service's status
    (served, pass and position) and its metrics all count the rows the loop got from each source;
    the asked share follows a change made for the next epoch."""
    pytest.importorskip("prometheus_client")
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    sizes = [len(build_index(photo_sources[kind])) for kind in KINDS]
    port = free_port()
    service = start_service(None, source=flags, batch_size=BATCH, metrics_port=port)
    with ServiceLoader(service.endpoint, weights=FIRST, epoch_samples=EPOCH, timeout=60) as loader:
        got = [row for batch in loader for row in rows(batch)]
        per_source = [sum(1 for s, _ in got if s == k) for k in range(3)]
        stats = loader.stats()["sources"]
        assert [stats[name]["samples"] for name in NAMES] == per_source
        assert [stats[name]["asked"] for name in NAMES] == list(FIRST.values())
        assert all(abs(stats[n]["share"] - FIRST[n]) <= 1 / EPOCH for n in NAMES), stats
        (session,) = status(service.endpoint)["sessions"]
        ledger = {row["source"]: row for row in session["sources"]}
        assert [ledger[name]["served"] for name in NAMES] == per_source
        for name, size, drawn in zip(NAMES, sizes, per_source, strict=True):
            assert ledger[name]["pass"] * size + ledger[name]["position"] == drawn
        line = f'dataferry_source_served_samples_total{{feed="train",source="shards"}} {per_source[1]}.0'
        assert scraped_within(port, line, 10.0), "the metrics report each source's rows (once a second)"
        loader.set_weights(THEN, at_batch=0)  # the next epoch's first batch
        assert [loader.stats()["sources"][name]["asked"] for name in NAMES] == list(THEN.values())
    assert service.stop() == 0


def test_a_source_whose_store_fails_makes_the_mixture_wait_and_shifts_nothing(
    fresh_s3_server: S3Server, photo_sources: dict[str, Path], start_service: ServiceFactory
) -> None:
    """One source in a store killed mid-epoch for longer than the workers' read deadline: the job
    waits for it, and once the store is back the epoch is the pure mixture's order, every row in
    its place: no position given to the local sources meanwhile, no sample reported bad."""
    fresh_s3_server.upload_tree(photo_sources["tar"], "shards")
    shards = f"s3://{fresh_s3_server.bucket}/shards/"
    flags = [f"folder={photo_sources['imagefolder']}", f"shards={shards}", f"list={photo_sources['csv']}"]
    sizes = [len(build_index(photo_sources[kind])) for kind in KINDS]
    service = start_service(
        None, source=flags, env=fresh_s3_server.env(), batch_size=4, slots=3, task_timeout=4
    )
    outage: Future[None] = Future()

    def one_epoch() -> tuple[list[tuple[int, int]], int]:
        got: list[tuple[int, int]] = []
        with ServiceLoader(service.endpoint, weights=FIRST, epoch_samples=EPOCH, timeout=60) as loader:
            for k, batch in enumerate(loader):
                if k == 2:
                    fresh_s3_server.kill()
                    outage.set_result(None)
                got += rows(batch)
            return got, loader.info.seed

    with in_background(one_epoch, "a mixture's epoch across the store's outage") as epoch:
        outage.result(60)
        service.wait_for(r"the data's store does not answer", 30)
        fresh_s3_server.restart()
        got, seed = epoch.result(90)
    assert got == expected(sizes, seed, EPOCH), "every row where the pure order puts it"
    assert status(service.endpoint)["feeds"][0]["bad_files"] == 0
    assert service.stop() == 0
