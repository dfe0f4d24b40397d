"""The arithmetic of the benchmark: medians, ratios, overlap, flatness, rolling rates. Pure functions.

Kept apart from everything that measures, so the numbers a report quotes can be unit-tested.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values: a scenario that produced nothing must not read as zero."""
    finite = [v for v in values if math.isfinite(v)]
    return float(statistics.median(finite)) if finite else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    result = numerator / denominator
    return result if math.isfinite(result) else None


def paired_ratio(first: Sequence[float], second: Sequence[float]) -> float | None:
    """Median of the per-round ratios ``first[i] / second[i]``.

    On a noisy machine a burst of other work slows whichever contender is being timed; pairing the
    contenders of one round and taking the median of their ratios cancels slow drift and ignores the
    odd burst, where a ratio of two medians would not.
    """
    if len(first) != len(second):
        return None
    ratios = [r for r in (ratio(a, b) for a, b in zip(first, second, strict=True)) if r is not None]
    return median(ratios)


def rate(images: int, seconds: float) -> float:
    """Images per second; zero for an empty interval rather than a division error."""
    return images / seconds if seconds > 0 else 0.0


def overlap_ratio(epoch_seconds: float, batches: int, load_seconds: float, compute_seconds: float) -> float:
    """Epoch time over its lower bound ``batches * max(load, compute)``.

    1.0 means loading hid completely behind the step (or the step behind loading); 2.0 means they ran
    one after the other.
    """
    bound = batches * max(load_seconds, compute_seconds)
    return epoch_seconds / bound if bound > 0 else math.inf


def growth(series: Sequence[float]) -> float:
    """How far any value after the first rose above the first (0 for fewer than two values)."""
    if len(series) < 2:
        return 0.0
    return max(0.0, max(series[1:]) - series[0])


def is_flat(series: Sequence[float], absolute: float, relative: float) -> bool:
    """No growth after the first value beyond ``max(absolute, relative * first)``.

    The allowance absorbs allocator and page-cache noise; a leak of a batch or more per epoch exceeds
    it within a few epochs.
    """
    if not series:
        return True
    return growth(series) <= max(absolute, relative * abs(series[0]))


@dataclass(frozen=True)
class RollingPoint:
    """Throughput and stall over the ``window`` batches ending at ``t`` seconds."""

    t: float
    images_per_second: float
    stall: float


def rolling(
    ends: Sequence[float], images: Sequence[int], waits: Sequence[float], window: int
) -> list[RollingPoint]:
    """Per-batch rolling throughput and data stall (fraction of wall time spent waiting for a batch).

    ``ends[i]`` is when batch ``i`` was done, in seconds since the timeline began at 0. Only full
    windows count: a point over the first batch or two would show noise, not a rate.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    points = []
    for i in range(window - 1, len(ends)):
        end = ends[i]
        j = i - window + 1
        start = ends[j - 1] if j > 0 else 0.0
        span = end - start
        if span <= 0:
            continue
        points.append(RollingPoint(end, sum(images[j : i + 1]) / span, sum(waits[j : i + 1]) / span))
    return points
