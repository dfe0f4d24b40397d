"""NOTE [ Input-bound verdict ]: one rule for the trainer's log, ``top`` and the alerts."""

from __future__ import annotations

import pytest

from protocol.verdict import share_from_demand, verdict, wait_share


@pytest.mark.parametrize(
    ("waited", "computed", "share", "called"),
    [
        (0.0, 0.0, 0.0, "fed"),
        (1.0, 99.0, 0.01, "fed"),
        (5.0, 95.0, 0.05, "fed"),
        (6.0, 94.0, 0.06, "somewhat input-bound"),
        (20.0, 80.0, 0.20, "somewhat input-bound"),
        (31.0, 69.0, 0.31, "input-bound"),
        (10.0, 0.0, 1.0, "input-bound"),
    ],
)
def test_the_share_and_its_verdict(waited: float, computed: float, share: float, called: str) -> None:
    assert wait_share(waited, computed) == pytest.approx(share)
    assert verdict(wait_share(waited, computed)) == called


def test_a_demand_is_the_same_share() -> None:
    assert share_from_demand(1.0) == 0.0
    assert share_from_demand(1.25) == pytest.approx(0.2)
    assert share_from_demand(float("nan")) == 0.0 and share_from_demand(0.5) == 0.0
    assert wait_share(float("inf"), 1.0) == 0.0, "a bad figure is no verdict, not a crash"
