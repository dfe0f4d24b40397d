"""How much of each batch this trainer decodes itself (``decode="auto"``): the share moves, while the
loop runs, to where neither side waits for the other. Pure: fed measurements, gives a share.

NOTE [ Finding the split ]
    The service's workers and this trainer's decode threads are two decoders of one stream of
    rows; the loop is fastest when neither is idle while the other holds it up. Every ``WINDOW``
    seconds the split looks at the loop's wait share over the window (NOTE [ Exposed wait ]), the
    decode threads' busy share (seconds decoding over seconds times threads) and the images the
    loop took per second, and moves the share of rows sent encoded by one step:
    * the loop waited (over ``WAITING``) and the threads had room (busy under ``BUSY``): the
      service is the one behind, so more rows come encoded;
    * the threads were busy over ``BUSY`` (whether the loop waited or not): fewer, so this
      process's decoding never becomes the ceiling nor takes the loop's own CPU when the service
      has room;
    * otherwise (fed, threads with room) it holds.
    A step is judged only once it is at work: the service applies a share to batches it plans
    after the next heartbeat, behind those already in flight, so the windows after a step are
    skipped until the share of rows this process decoded is nearer the share asked than the one
    before the step (or ``MOST_WAITS`` windows have passed: rows that cannot go encoded keep it
    below); a fixed distance would take a small step's stale windows for its own. Then a
    step that was followed by fewer images a second (by more than ``WORSE``) than the window
    before it is taken back, and the step halves: what the two shares do not see (this process's
    threads slowing its own loop on a CPU device, say) still cannot cost the loop for long. A
    step in the same direction as the last doubles, up to ``MOST_STEP``; one that reverses halves,
    down to ``LEAST_STEP``: it settles within a few windows and follows a change (a neighbour
    taking the service's cores, a model that gets slower) as fast. The service applies the share
    to batches it plans from then on (NOTE [ Encoded rows ] in protocol/encoded.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from protocol.encoded import MAX_SHARE

WINDOW: Final = 1.0
WAITING: Final = 0.05
"""A wait share above this is waiting (``protocol.verdict``'s *somewhat input-bound*)."""
BUSY: Final = 0.85
WORSE: Final = 0.15
"""A window this much slower than the one before a step takes the step back. One-second windows of
a loop vary by about a tenth (an epoch's start falls in some): at 0.05, noise took good steps back
(`python -m benchmarks.split`: one round of three stuck at a share of 0, 0.83 of the better fixed
extreme, where the other two settled at 0.62 and read 1.49 of it)."""
FIRST_STEP: Final = 125
MOST_STEP: Final = 250
LEAST_STEP: Final = 16
MOST_WAITS: Final = 4


@dataclass(frozen=True)
class Window:
    """What one window measured."""

    seconds: float
    waited: float
    computed: float
    images: int
    busy: float
    """Decode threads' busy share over the window, in [0, 1]."""
    realized: float = -1.0
    """The share of the window's rows this process decoded (-1: not known)."""

    @property
    def wait_share(self) -> float:
        total = self.waited + self.computed
        return self.waited / total if total > 0 else 0.0

    @property
    def rate(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


class Split:
    """The share of rows this trainer decodes, in thousandths; ``fixed`` holds it where it is."""

    def __init__(self, share: int, fixed: bool) -> None:
        self.share = max(0, min(MAX_SHARE, share))
        self.fixed = fixed
        self._step = FIRST_STEP
        self._last_move = 0
        """The last step taken (signed), 0 when the last window held."""
        self._before = self.share
        """The share before the last step."""
        self._last_rate = 0.0
        self._waited = 0
        """Windows since the last step that did not see it at work yet."""
        self.moves = 0

    def observe(self, window: Window) -> int:
        """Take one window's figures; the share from now on."""
        if self.fixed or window.seconds <= 0:
            return self.share
        if self._last_move and not self._in_effect(window):
            return self.share  # the last step is not at work yet: nothing to judge it by
        self._waited = 0
        rate = window.rate
        if self._last_move and self._last_rate > 0 and rate < (1 - WORSE) * self._last_rate:
            self._move(-self._last_move, reverse=True)  # it got worse: back where it was
            self._last_move = 0
            self._last_rate = rate
            return self.share
        self._last_rate = rate
        if window.busy > BUSY:
            direction = -1
        elif window.wait_share > WAITING:
            direction = 1
        else:
            direction = 0
        if direction == 0:
            self._last_move = 0
            return self.share
        self._adapt(direction)
        self._last_move = self._move(direction * self._step)
        return self.share

    def _in_effect(self, window: Window) -> bool:
        """Whether the window saw the share the last step asked for (its rows' share is nearer it
        than the share before), or has waited ``MOST_WAITS`` windows for it (rows that cannot go
        encoded keep it below)."""
        now, before = self.share / MAX_SHARE, self._before / MAX_SHARE
        if window.realized < 0 or abs(window.realized - now) < abs(window.realized - before):
            return True
        self._waited += 1
        return self._waited > MOST_WAITS

    def _adapt(self, direction: int) -> None:
        if self._last_move and (self._last_move > 0) != (direction > 0):
            self._step = max(LEAST_STEP, self._step // 2)
        elif self._last_move:
            self._step = min(MOST_STEP, self._step * 2)

    def _move(self, by: int, reverse: bool = False) -> int:
        """Move the share by ``by`` (clipped); the move made."""
        before = self._before = self.share
        self.share = max(0, min(MAX_SHARE, self.share + by))
        if reverse:
            self._step = max(LEAST_STEP, self._step // 2)
        if self.share != before:
            self.moves += 1
        return self.share - before
