"""The cache-policy simulation (benchmarks.cache_policy): exact results where they are known."""

from __future__ import annotations

import json

import pytest

from benchmarks.cache_policy import (
    POLICIES,
    Ordered,
    format_table,
    make_cache,
    permutations,
    photo_sizes,
    run,
    simulate,
    to_json,
)


@pytest.mark.parametrize("slack", [0, 9])  # an exact fit, and a budget just short of one more slot
def test_keep_with_equal_sizes_hits_its_slots_share_every_warm_epoch(slack: int) -> None:
    samples, size, slots = 1000, 10, 237
    cache = make_cache("keep", slots * size + slack)
    hits, hit_bytes = simulate(cache, [size] * samples, permutations(samples, 4))
    assert hits[1:] == [slots / samples] * 3
    assert hit_bytes[1:] == [slots / samples] * 3


@pytest.mark.parametrize("policy", POLICIES)
def test_first_epoch_is_all_misses_and_the_budget_is_never_exceeded(policy: str) -> None:
    sizes = photo_sizes(500)
    budget = sum(sizes) // 2
    cache = make_cache(policy, budget)
    hits, hit_bytes = simulate(cache, sizes, permutations(500, 3))
    assert hits[0] == hit_bytes[0] == 0.0
    assert 0 < cache.max_used <= budget
    assert all(0 < h < 1 for h in hits[1:])


def test_lru_evicts_the_least_recently_used_and_fifo_the_oldest() -> None:
    lru, fifo = Ordered(3, refresh_on_hit=True), Ordered(3, refresh_on_hit=False)
    for cache in (lru, fifo):
        for key in (1, 2, 3, 1):  # 1 is the oldest admitted, and (after its hit) the most recently used
            cache.lookup(key, 1)
        assert not cache.lookup(4, 1)
    assert list(lru.held) == [3, 1, 4]
    assert list(fifo.held) == [2, 3, 4]


def test_a_sample_larger_than_the_budget_is_never_admitted_nor_evicts() -> None:
    for policy in ("lru", "fifo", "random"):
        cache = make_cache(policy, 10)
        cache.lookup(1, 6)
        assert not cache.lookup(2, 11)
        assert cache.lookup(1, 6), policy


def test_keep_closes_at_the_first_sample_that_does_not_fit() -> None:
    visits = ((1, 4), (2, 4), (3, 5), (4, 1))  # 3 does not fit; 4 would, but comes after
    cache = make_cache("keep", 10)
    for key, size in visits:
        cache.lookup(key, size)
    assert [cache.lookup(key, size) for key, size in visits] == [True, True, False, False]


def test_run_is_deterministic_and_reports_every_policy_and_budget() -> None:
    first, second = run(400, 3), run(400, 3)
    assert first == second
    assert len(first) == 2 * 3 * len(POLICIES)
    assert all(r.max_bytes_held <= r.budget_bytes for r in first)
    doc = json.loads(to_json(first, 400, 3, 0))
    assert len(doc["results"]) == len(first) and "mean_hit_ratio_2plus" in doc["results"][0]
    assert len(format_table(first).splitlines()) == len(first) + 2
