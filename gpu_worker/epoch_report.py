"""The line a ``ServiceLoader`` logs at the end of each epoch: images/s, the share of the epoch the
loop waited for data, and whether it is input-bound, with what to do about it (issue 39).

It is logged at INFO on ``gpu_worker.passes``, so a trainer that configures nothing (Python's
WARNING) sees nothing; ``logging.basicConfig(level=logging.INFO)`` shows it. ``loader.stats()``
holds the same numbers under ``"epoch"``. The verdict is NOTE [ Input-bound verdict ]'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.verdict import VERDICTS, verdict, wait_share

ADVICE = {
    VERDICTS[0]: "the model sets the pace",
    VERDICTS[
        1
    ]: "the data nearly keeps up: more credits= hide short stalls, more decode capacity removes them",
    VERDICTS[2]: (
        "give the service more decode capacity (cores or --cpu-budget, another service in the "
        "fleet), or decode less per step (--cache-memory, smaller images)"
    ),
}


@dataclass(frozen=True)
class EpochReport:
    """One pass over an epoch, as the loop saw it."""

    epoch: int
    batches: int
    images: int
    seconds: float
    waited: float
    computed: float

    @property
    def wait_share(self) -> float:
        return wait_share(self.waited, self.computed)

    @property
    def verdict(self) -> str:
        return verdict(self.wait_share)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """``epoch 3: 1210 images/s, 31% of the time waiting for data: input-bound: give ...``"""
        return (
            f"epoch {self.epoch}: {self.images_per_s:.0f} images/s over {self.batches} batches, "
            f"{self.wait_share:.0%} of the time waiting for data: {self.verdict}: {ADVICE[self.verdict]}"
        )

    def stats(self) -> dict[str, object]:
        """``loader.stats()["epoch"]``."""
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "images": self.images,
            "images_per_s": round(self.images_per_s, 1),
            "wait_share": round(self.wait_share, 4),
            "verdict": self.verdict,
        }
