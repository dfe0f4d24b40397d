"""Recent rates for status and metrics: events per second over a sliding window."""

from __future__ import annotations

import time
from collections import deque

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
