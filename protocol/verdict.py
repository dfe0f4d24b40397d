"""Is a training loop input-bound? One rule for every place that answers (issue 39): the trainer's
epoch log line and ``loader.stats()``, ``loader-service top``, and the Prometheus rules. Pure.

NOTE [ Input-bound verdict ]
    A loop's *wait share* is the time it spent blocked in ``next()`` over the time it ran:
    ``waited / (waited + computed)`` (NOTE [ Exposed wait ] in gpu_worker/loop_clock.py), in
    [0, 1]; from a demand (``(waited + computed) / computed``, NOTE [ Fleet load ]) it is
    ``1 - 1 / demand``. Above ``INPUT_BOUND`` (20 %) the loop is *input-bound*: the data, not the
    model, sets its pace. Above ``SOMEWHAT`` (5 %) it is *somewhat input-bound*. Below, it is
    *fed*. These are the thresholds TensorFlow's profiler uses for its input-pipeline analysis,
    so a user who knows that tool reads the same answer here.
"""

from __future__ import annotations

import math
from typing import Final

INPUT_BOUND: Final = 0.20
SOMEWHAT: Final = 0.05
VERDICTS: Final = ("fed", "somewhat input-bound", "input-bound")


def wait_share(waited: float, computed: float) -> float:
    """``waited / (waited + computed)``, 0 for a loop that has not run, always in [0, 1]."""
    total = waited + computed
    if not math.isfinite(total) or total <= 0:
        return 0.0
    return min(1.0, max(0.0, waited / total))


def share_from_demand(demand: float) -> float:
    """The wait share a demand (``(waited + computed) / computed``, at least 1) stands for."""
    if not math.isfinite(demand) or demand <= 1.0:
        return 0.0
    return 1.0 - 1.0 / demand


def verdict(share: float) -> str:
    """``fed``, ``somewhat input-bound`` or ``input-bound`` for a wait share."""
    if share > INPUT_BOUND:
        return VERDICTS[2]
    if share > SOMEWHAT:
        return VERDICTS[1]
    return VERDICTS[0]
