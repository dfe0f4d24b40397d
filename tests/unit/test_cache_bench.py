"""Scenario (o)'s arithmetic (benchmarks.cache): cache sizes, hit ratios, the memory check, the lines."""

from __future__ import annotations

import pytest

from benchmarks.cache import (
    Verdict,
    cache_bytes,
    hit_ratio,
    memory_allowance,
    memory_excess,
    ratio_verdict,
)
from loader_service.decode.cache import entry_bytes, overhead_bytes


def test_a_cache_for_every_sample_is_its_entries_plus_overhead_plus_margin() -> None:
    sizes = [100, 3 * 224 * 224, 1]
    expected = overhead_bytes(3, 2) + sum(entry_bytes(s) for s in sizes) + 7
    assert cache_bytes(sizes, workers=2, margin=7) == expected


def test_a_half_cache_keeps_half_the_entries_bytes_and_the_whole_overhead() -> None:
    sizes = [1000] * 10
    full, half = cache_bytes(sizes, workers=2), cache_bytes(sizes, workers=2, share=0.5)
    assert full - half == 5 * entry_bytes(1000)
    assert half - overhead_bytes(10, 2) == 5 * entry_bytes(1000)


def test_hit_ratio_is_taken_from_the_counters_deltas() -> None:
    before = {"hits": 10, "misses": 90}
    assert hit_ratio(before, {"hits": 40, "misses": 100}) == pytest.approx(0.75)
    assert hit_ratio(before, before) is None


def test_memory_excess_compares_the_highest_figures() -> None:
    # With a cache of 100 MiB: at most the highest figure without it + 100.
    assert memory_excess([200, 203], [100, 101], 100) == pytest.approx(2)
    assert memory_excess([203, 190], [90, 104], 100) < 0
    assert memory_allowance([100, 300]) == pytest.approx(6)  # 2% of 300
    assert memory_allowance([10]) == pytest.approx(4)  # the 4 MiB floor


def test_lines_show_value_target_and_verdict() -> None:
    assert ratio_verdict("train", 2.6, "a against b", 2.5).line() == (
        "(o) train | 2.60x (a against b) | target >= 2.5x | PASS"
    )
    assert ratio_verdict("eval", None, "nothing", 10).line().endswith("| FAIL")
    assert Verdict("half", "hits 50%").line() == "(o) half | hits 50% | target - | -"
