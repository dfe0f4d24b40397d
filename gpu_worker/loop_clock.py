"""How a training loop spends its time: blocked in ``next()`` on the loader, or computing between pulls.

NOTE [ Exposed wait ]
    What a trainer waits for data is only the time its loop is blocked in ``next()`` on the loader
    (the pull), not whatever the loop does with a batch afterwards: the time from a batch handed to
    the loop to the loop's next ``next()`` is its compute. Both are counted here, in the loop's own
    thread, and reported in every heartbeat (cumulative milliseconds, so a lost heartbeat loses
    nothing), with the number of batches pulled (a service divides compute by it to see a step
    get slower), to every service the loader is attached to: the services' load (NOTE [ Fleet load ]
    in loader_service/supervisor/trainers/load.py) comes from it. Time outside an epoch's iteration (between
    epochs, evaluation, a loop that stopped pulling) counts as neither. ``loader.stats()`` shows the
    same two figures.
"""

from __future__ import annotations

import threading
import time


class LoopClock:
    """Seconds a loop spent waiting on the loader and computing; read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waited = 0.0
        self._computed = 0.0
        self._pulls = 0
        self._state = ""
        """'' (outside an iteration), "wait" (in ``next()``) or "compute" (holding a batch)."""
        self._since = 0.0

    def _switch(self, state: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self._state == "wait":
                self._waited += now - self._since
            elif self._state == "compute":
                self._computed += now - self._since
            self._state, self._since = state, now

    def waiting(self) -> None:
        """The loop asked for its next batch."""
        self._switch("wait")

    def computing(self) -> None:
        """The loop got its batch."""
        self._switch("compute")
        with self._lock:
            self._pulls += 1

    @property
    def pulls(self) -> int:
        """Batches the loop has been handed."""
        return self._pulls

    def idle(self) -> None:
        """The loop left the epoch (ended, broke out, or was abandoned)."""
        self._switch("")

    def totals(self) -> tuple[float, float]:
        """(waited, computed) seconds so far, the current stretch included."""
        now = time.monotonic()
        with self._lock:
            waited, computed = self._waited, self._computed
            if self._state == "wait":
                waited += now - self._since
            elif self._state == "compute":
                computed += now - self._since
        return waited, computed
