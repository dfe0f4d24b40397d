"""NOTE [ A slide beyond the noise ]: how ``python -m benchmarks.compare`` judges its rounds (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.compare.verdict import FLOOR, judge, oriented, table


def rate(value: float) -> dict[str, Any]:
    return {"value": value, "unit": "images/s", "higher_is_better": True}


def seconds(value: float) -> dict[str, Any]:
    return {"value": value, "unit": "s", "higher_is_better": False}


def test_a_ratio_above_one_means_b_is_better_whichever_way_the_figure_points() -> None:
    assert oriented(100, 110, True) == pytest.approx(1.1)
    assert oriented(0.10, 0.08, False) == pytest.approx(1.25), "a shorter time is better"
    assert oriented(0.0, 5.0, True) == float("inf") and oriented(0.0, 0.0, True) == 1.0


def test_a_slide_is_judged_against_the_rounds_own_spread() -> None:
    steady = judge("train", [(rate(100), rate(90)), (rate(100), rate(91)), (rate(102), rate(91))])
    assert steady.ratio == pytest.approx(0.90, abs=0.005) and steady.spread < 0.02
    assert steady.slid and steady.verdict == "SLID", "9 % worse, rounds agreeing within 1 %"
    noisy = judge("train", [(rate(100), rate(70)), (rate(100), rate(90)), (rate(100), rate(110))])
    assert noisy.ratio == pytest.approx(0.9) and noisy.spread == pytest.approx(0.2)
    assert not noisy.slid, "rounds that disagree by 20 % cannot condemn a 10 % difference"


def test_small_differences_stay_within_the_floor() -> None:
    same = judge("cold", [(seconds(0.100), seconds(0.103)), (seconds(0.100), seconds(0.102))])
    assert same.spread < FLOOR and same.verdict == "within noise"
    better = judge("cold", [(seconds(0.100), seconds(0.080)), (seconds(0.100), seconds(0.081))])
    assert better.verdict == "better" and not better.slid


def test_a_scenario_a_revision_cannot_run_is_said_not_judged() -> None:
    outcome = judge("ramp", [({"error": "no such flag"}, rate(10)), ({"error": "no such flag"}, rate(11))])
    assert outcome.error == "no such flag" and not outcome.slid and outcome.verdict == "not run"
    assert "not run: no such flag" in table([outcome], "A", "B")
    mixed = judge("ramp", [({"error": "timed out"}, rate(10)), (rate(10), rate(11))])
    assert mixed.rounds == 1 and mixed.ratio == pytest.approx(1.1), "the rounds that ran are judged"
