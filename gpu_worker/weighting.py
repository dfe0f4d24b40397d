"""A weighted job's weight changes, as the trainer keeps them: checked, placed at positions of the
run, sent with every start and kept in the checkpoint. Pure: no sockets.

NOTE [ Weight changes ]
    ``loader.set_weights(weights, at_batch=K)`` is called on every rank with the same arguments, as
    ``set_epoch`` is. ``K`` counts this rank's batches of the current pass: of the epoch from its
    start, or from where a resumed epoch began (the ``position`` a start names). The new weights
    apply from the first sample of that step on: global position ``epoch * epoch_samples +
    consumed(offset, K)`` (``protocol.shares.consumed``: the job's ``K`` steps of ``world_size x
    batch_size`` samples after the offset), a position and not a step, so a resume at another
    world size finds the change where it was. No collective is needed: the ranks compute the same
    position from the same arguments.

    The changes travel in every ``Start`` (``Start.changes``, at most ``MAX_WEIGHT_CHANGES``) and
    in ``state_dict()`` (``weight_changes``), so ``load_state_dict`` resumes the very same sequence
    at any world size; the first weights stay the constructor's, which the feed's fingerprint
    covers. A change during a pass starts the pass's runs again from the loop's next batch: the
    services may have decoded that far ahead with the old weights, so the batches the loop has
    not taken (at most the credits of each service) are decoded again. Refused, naming why: a
    change before the loop's next sample (already past) or before an earlier change, a batch past
    the pass, weights that are not one finite number >= 0 for each source and only those, all
    zero. The same change given again (a script that sets its weights at every start) is no
    change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.messages import MAX_WEIGHT_CHANGES
from protocol.weights import ordered_weights

Change = tuple[int, tuple[float, ...]]
"""(global position, each source's weight in the feed's order)"""
STATE_KEY = "weight_changes"


@dataclass(frozen=True)
class WeightChanges:
    """The changes a job made after its first weights (NOTE [ Weight changes ]), positions rising."""

    changes: tuple[Change, ...] = ()

    def then(self, position: int, weights: tuple[float, ...], next_sample: int) -> WeightChanges:
        """With ``weights`` from ``position`` on; ``next_sample``: the loop's next position."""
        if (position, weights) in self.changes:
            return self
        if position < next_sample:
            raise ValueError(
                f"that step is already past: the change would start at sample {position} of the run, "
                f"and the loop's next sample is {next_sample}"
            )
        last = self.changes[-1][0] if self.changes else 0
        if position < last:
            raise ValueError(
                f"a weight change at sample {position} of the run is before the last one, at {last}"
            )
        kept = tuple(c for c in self.changes if c[0] < position)
        if len(kept) >= MAX_WEIGHT_CHANGES:
            raise ValueError(f"a job may change its weights at most {MAX_WEIGHT_CHANGES} times")
        return WeightChanges((*kept, (position, weights)))

    def state(self) -> dict[str, Any]:
        """What ``state_dict()`` adds: nothing without changes, so states stay as they were."""
        if not self.changes:
            return {}
        return {STATE_KEY: [[position, list(weights)] for position, weights in self.changes]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], sources: int) -> WeightChanges:
        """The changes a checkpoint holds; ValueError naming what is wrong with them."""
        saved = state.get(STATE_KEY, [])
        if type(saved) is not list or len(saved) > MAX_WEIGHT_CHANGES:
            raise ValueError(f"state has invalid {STATE_KEY}: a list of at most {MAX_WEIGHT_CHANGES}")
        changes: list[Change] = []
        for item in saved:
            if (
                type(item) is not list
                or len(item) != 2
                or type(item[0]) is not int
                or item[0] < (changes[-1][0] if changes else 0)
                or type(item[1]) is not list
                or len(item[1]) != sources
            ):
                raise ValueError(f"state has an invalid weight change: {item!r:.200}")
            names = [str(i) for i in range(sources)]
            weights = ordered_weights(dict(zip(names, item[1], strict=True)), names)
            changes.append((item[0], weights))
        return cls(tuple(changes))

    def asked(self, first: Sequence[float], at: int) -> tuple[float, ...]:
        """The shares asked for at global position ``at``: the last change there, or ``first``."""
        weights = next((w for p, w in reversed(self.changes) if p <= at), tuple(first))
        return tuple(w / sum(weights) for w in weights)


def source_stats(
    names: Sequence[str], served: Mapping[int, int], asked: Sequence[float]
) -> dict[str, dict[str, float]]:
    """``loader.stats()["sources"]``: per source, the rows handed to the loop, their share of all of
    them, and the share asked for now; empty for a feed of one source."""
    if len(names) < 2:
        return {}
    total = sum(served.values())
    return {
        name: {
            "samples": served.get(i, 0),
            "share": round(served.get(i, 0) / total, 4) if total else 0.0,
            "asked": round(asked[i], 4),
        }
        for i, name in enumerate(names)
    }
