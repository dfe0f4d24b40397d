"""The weight rule both sides keep: a job's weights checked against a feed's sources, put in the
sources' order, and scaled to whole numbers that sum to ``WEIGHT_UNIT``. A trainer applies it
before anything reaches the wire (``ServiceLoader(weights=)``, ``set_weights``); the service applies
the same rule to what a hello or a start carries, a peer's numbers, before it plans (NOTE [ Mixture
order ] in loader_service/dataset/mixture.py). One rule, so that a weighting the trainer accepts
is never refused by the service for a reason it was not told, nor the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Final

WEIGHT_UNIT: Final = 1 << 32
"""The sum the weights are scaled to: a share is exact to 1 part in 4 billion."""
MAX_EPOCH_SAMPLES: Final = 1 << 24
"""Positions of one mixture epoch (a trainer's ``epoch_samples``): the service chooses them on its
one chooser thread (0.3 s at this bound in C, NOTE [ Mixture order ]) and holds them as marks
(12 KiB at this bound with three sources, NOTE [ Epoch marks ]), so a peer's number is bounded here,
on the wire and in the service alike."""


class WeightError(ValueError):
    """Weights that cannot be: the text names the source and what is wrong with its weight."""


def check_weight(name: str, value: object) -> None:
    """WeightError unless ``value`` is a finite number >= 0 (a bool is no weight)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise WeightError(f"weight of {name!r} must be a finite number >= 0, got {value!r}")


def ordered_weights(weights: Mapping[str, object], sources: Sequence[str]) -> tuple[float, ...]:
    """``weights`` in the order of ``sources``; WeightError naming a name that is not a source, a
    source left out (0 skips one), a weight that is not a finite number >= 0, or weights that are
    all zero."""
    unknown = sorted(set(weights) - set(sources))
    missing = [name for name in sources if name not in weights]
    if unknown or missing:
        wrong = [
            f"unknown {', '.join(unknown)}" if unknown else "",
            f"missing {', '.join(missing)}" if missing else "",
        ]
        raise WeightError(
            f"weights must name each source of the feed ({', '.join(sources)}) once, 0 to skip one: "
            + "; ".join(part for part in wrong if part)
        )
    values = [weights[name] for name in sources]
    for name, value in zip(sources, values, strict=True):
        check_weight(name, value)
    if not any(values):
        raise WeightError("weights are all zero: at least one source must have a weight above 0")
    return tuple(float(v) for v in values)  # type: ignore[arg-type]  # checked: int or float


def whole_weights(weights: Mapping[str, object], sources: Sequence[str]) -> tuple[int, ...]:
    """``ordered_weights`` as whole numbers summing to ``WEIGHT_UNIT`` exactly (largest remainders,
    in exact fractions): every step of a mixture's choice is then integer arithmetic, which no
    platform rounds differently."""
    exact = [Fraction(v) for v in ordered_weights(weights, sources)]
    total = sum(exact)
    shares = [w * WEIGHT_UNIT / total for w in exact]
    scaled = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (scaled[i] - shares[i], i))
    for i in by_remainder[: WEIGHT_UNIT - sum(scaled)]:
        scaled[i] += 1
    return tuple(scaled)
