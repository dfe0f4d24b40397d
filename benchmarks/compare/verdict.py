"""What a comparison says, from the figures of its rounds: pure, no processes.

NOTE [ A slide beyond the noise ]
    Each round measures A and B back to back (A first in even rounds, B first in odd ones), so a
    slow minute of a shared machine hits both of a pair. Per round the scenario's figure gives a
    ratio oriented so that above 1 is better for B: ``B / A`` for a rate, ``A / B`` for a time or
    a size. The comparison quotes the median of those ratios, and as its spread the largest
    distance of a round's ratio from that median (the rounds' own disagreement: the noise this run
    measured). B slid when the median is below ``1 - tolerance``, the tolerance being the spread
    or ``FLOOR``, whichever is larger: one round can neither condemn nor excuse a change alone,
    and two runs of one revision (``HEAD HEAD``) read within it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FLOOR = 0.05
"""The least tolerance, whatever the rounds agree on: below 5 % a 2-core shared machine cannot tell a
change from the next minute."""


@dataclass(frozen=True)
class Outcome:
    """One scenario's verdict."""

    scenario: str
    unit: str
    higher_is_better: bool
    a: float
    """The median of A's figures."""
    b: float
    ratio: float
    """The median per-round ratio, above 1 better for B (NOTE [ A slide beyond the noise ])."""
    spread: float
    rounds: int
    error: str = ""

    @property
    def tolerance(self) -> float:
        return max(self.spread, FLOOR)

    @property
    def slid(self) -> bool:
        return not self.error and self.ratio < 1 - self.tolerance

    @property
    def verdict(self) -> str:
        if self.error:
            return "not run"
        if self.slid:
            return "SLID"
        return "better" if self.ratio > 1 + self.tolerance else "within noise"

    def row(self) -> dict[str, Any]:
        return {
            "name": self.scenario,
            "ratio": round(self.ratio, 4),
            "spread": round(self.spread, 4),
            "a": self.a,
            "b": self.b,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "rounds": self.rounds,
            "verdict": self.verdict,
            **({"error": self.error} if self.error else {}),
        }


def oriented(a: float, b: float, higher_is_better: bool) -> float:
    """B against A, above 1 when B is better; a zero on the worse side is an infinite loss, not a crash."""
    num, den = (b, a) if higher_is_better else (a, b)
    if den <= 0:
        return float("inf") if num > 0 else 1.0
    return num / den


def judge(scenario: str, pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> Outcome:
    """The verdict on ``pairs``: one (A's result, B's result) per round, as the probe printed them."""
    errors = [r["error"] for pair in pairs for r in pair if "error" in r]
    good = [(a, b) for a, b in pairs if "error" not in a and "error" not in b]
    if not good:
        return Outcome(scenario, "", True, 0.0, 0.0, 1.0, 0.0, 0, errors[0] if errors else "no rounds")
    unit, higher = good[0][0]["unit"], bool(good[0][0]["higher_is_better"])
    ratios = [oriented(float(a["value"]), float(b["value"]), higher) for a, b in good]
    middle = statistics.median(ratios)
    spread = max(abs(r - middle) for r in ratios)
    return Outcome(
        scenario,
        unit,
        higher,
        statistics.median(float(a["value"]) for a, _ in good),
        statistics.median(float(b["value"]) for _, b in good),
        middle,
        spread,
        len(good),
    )


def table(outcomes: Sequence[Outcome], a: str, b: str) -> str:
    """The printed table: one scenario a row."""
    head = f"{'scenario':<12} {'A':>12} {'B':>12} {'unit':<13} {'B vs A':>7} {'spread':>7} {'n':>2}  verdict"
    lines = [f"A = {a}", f"B = {b}", "(B vs A above 1: B better; a time or a size is inverted)", head]
    for o in outcomes:
        if o.error:
            lines.append(
                f"{o.scenario:<12} {'-':>12} {'-':>12} {'':<13} {'-':>7} {'-':>7} {0:>2}  not run: {o.error}"
            )
            continue
        lines.append(
            f"{o.scenario:<12} {_num(o.a):>12} {_num(o.b):>12} {o.unit:<13} {o.ratio:>7.3f} "
            f"{'±' + format(o.spread, '.3f'):>7} {o.rounds:>2}  {o.verdict}"
        )
    return "\n".join(lines)


def _num(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e6 else f"{value / 2**20:.1f} Mi"
