"""What status and metrics count: recent rates (events per second over a sliding window) and each
feed's counters."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

WINDOW = 10.0


class RateMeter:
    """Counts events; ``rate()`` is events per second over about the last ``WINDOW`` seconds."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self.total = 0
        self._marks: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def add(self, n: int, now: float | None = None) -> None:
        self.total += n
        now = time.monotonic() if now is None else now
        if now - self._marks[-1][0] >= 0.5:  # one mark per half second bounds the memory
            self._marks.append((now, self.total))
        while len(self._marks) > 2 and now - self._marks[1][0] > self.window:
            self._marks.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        start_time, start_total = self._marks[0]
        elapsed = now - start_time
        return (self.total - start_total) / elapsed if elapsed > 0 else 0.0


@dataclass
class FeedCounters:
    decoded: RateMeter = field(default_factory=RateMeter)
    batches: int = 0
    bad_files: int = 0
    warm_decoded: int = 0
    """Images decoded for the warm start (NOTE [ Warm start ]), included in ``decoded``."""
    split_batches: int = 0
    """Batches decoded in parts by several workers at once (NOTE [ Split batches ])."""
    encoded: int = 0
    """Of the rows the workers wrote (``decoded``), those left encoded for their trainers to decode
    (NOTE [ Encoded rows ])."""
    served_by_source: npt.NDArray[np.int64] | None = None
    """Rows announced to trainers, by source (NOTE [ Source ledger ]); None: one source."""
    store_waits: int = 0
    """Tasks a worker handed back because the data's store did not answer within its read deadline
    (NOTE [ Object store reads ]): each is tried again, so this counts the store's silences."""
