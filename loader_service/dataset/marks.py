"""A mixture epoch's order held as marks: where the rule stands every ``stride`` positions, and any
window of positions walked again from the nearest one when it is asked for (issue 45).

NOTE [ Epoch marks ]
    An epoch's order (NOTE [ Mixture order ]) is a walk: which source position ``j`` draws depends
    only on the sources' deficits after the positions before it. Held whole it cost 6 bytes a
    position, 96 MiB for the largest epoch, for every job with weights of its own (16 such jobs
    took a service from 47 MiB to 1585 MiB). It is held instead as the walk's state every
    ``stride`` positions, and a window of positions is walked again when a batch, or a status, asks
    for it. A source's deficit is ``r + q * total``, where ``r`` is its target so far (its weights
    times the positions walked) modulo ``total``, known without walking, and ``q`` a small integer
    (the deficits stay within a few ``total``s of 0), so a mark is one byte a source: the largest
    epoch of three sources holds 12 KiB. ``stride`` is the power of two at or below ``2^14 / k``
    (``k`` sources, 256 positions at least): a window begins at most ``stride`` positions past
    where a walk may start, about 2^14 source steps (50 us here, in C), and the marks of the
    largest epoch take ``2^24 * k / stride`` bytes (256 KiB with 16 sources, 16 MiB with 256). A
    walk may also start where an earlier window ended (``CURSORS`` are kept): a stream plans its
    batches in order, so each batch walks only its own positions. Where each source stands at a
    position (the ledger, NOTE [ Source ledger ]) is the same walk, no longer than a window.
    The walk of a whole epoch, that sets its marks, runs on the chooser thread (NOTE [ Choosing off
    the main loop ]) in chunks of ``CHUNK`` positions, and stops between two when asked to. Its
    marks depend on the epoch's length and the weights in it alone (``Rule``), so every epoch and
    every job with the same ones share them: ``SHELF`` keeps those an order alive holds, the
    ``RECENT_ORDERS`` latest besides, and the counts of many more (where the sources stand at an
    epoch sums the epochs before it).
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from protocol.messages import MAX_WEIGHT_CHANGES

Segments = tuple[tuple[int, tuple[int, ...]], ...]
"""Weights from positions of an epoch on, the first at 0 (``Weighting.within``)."""
C_MAX_TOTAL = 1 << 44
C_MAX_SOURCES = 256
"""What ``_mixture.c`` takes: larger sums (weights of sources' sizes past 2^44) are walked in Python."""
STEPS = 1 << 14
"""Source steps a window may walk past its start, at most (NOTE [ Epoch marks ])."""
MIN_STRIDE = 256
CHUNK = 1 << 20
"""Positions the chooser walks between two looks at whether it should stop."""
CURSORS = 4
"""Where the latest windows ended, kept to walk on from."""
RECENT_ORDERS = 4
"""Epochs' marks kept after their last holder let go (a job that attaches again, the next epoch)."""
KEPT_COUNTS = 4 * MAX_WEIGHT_CHANGES
"""Epochs' counts kept: where the sources stand at an epoch sums them (``Mixture.before``)."""
Going = Callable[[], bool]
"""Asked between chunks of a walk: whether to go on (NOTE [ Choosing off the main loop ])."""
T = TypeVar("T")


def always() -> bool:
    return True


_mixture: ModuleType | None
try:
    from loader_service.dataset import _mixture
except ImportError:  # not built (no C compiler at install): the same walk, in Python
    _mixture = None
if _mixture is not None and not hasattr(_mixture, "walk"):  # built from an older _mixture.c
    _mixture = None
SLOW_WALK = (
    None
    if _mixture is not None
    else "mixture order: walked in Python, about 150 times slower than C, on the main loop at each "
    "weighted batch and status (_mixture not built, or built before walk(): pip install -e . again)"
)
"""What the service warns of at start where weighted jobs would walk their orders in Python."""


@dataclass(frozen=True)
class Rule:
    """The integers the rule walks by (NOTE [ Mixture order ]): deficits in units of ``1 / total``,
    every segment's weights scaled to that one sum, so that the deficits left at a change carry
    over exactly."""

    bounds: tuple[int, ...]
    """Each segment's first position (the first 0), then the epoch's length."""
    scaled: tuple[tuple[int, ...], ...]
    total: int

    @classmethod
    def of(cls, samples: int, segments: Segments) -> Rule:
        total = math.lcm(*(sum(w) for _, w in segments))
        starts = tuple(min(p, samples) for p, _ in segments)
        scaled = tuple(tuple(w * (total // sum(given)) for w in given) for _, given in segments)
        return cls((*starts, samples), scaled, total)

    @property
    def samples(self) -> int:
        return self.bounds[-1]

    @property
    def sources(self) -> int:
        return len(self.scaled[0])

    @cached_property
    def in_c(self) -> bool:
        return _mixture is not None and self.total < C_MAX_TOTAL and self.sources <= C_MAX_SOURCES

    @cached_property
    def stride(self) -> int:
        """Positions between two marks (NOTE [ Epoch marks ])."""
        return stride_for(self.sources, self.samples)

    def state_at(self, position: int, marks: npt.NDArray[np.int8]) -> State:
        """The walk's state at a mark's ``position``, from the mark's ``q`` of each source: O(k)."""
        segment = min(bisect.bisect_right(self.bounds, position) - 1, len(self.scaled) - 1)
        walked = position - self.bounds[segment]
        deficit, drawn = [], []
        for base, weight, q in zip(
            self._targets[segment], self.scaled[segment], marks[position // self.stride].tolist(), strict=True
        ):
            target = base + weight * walked
            d = target % self.total + q * self.total
            deficit.append(d)
            drawn.append((target - d) // self.total)
        return State(position, np.asarray(deficit, np.int64), np.asarray(drawn, np.int64))

    @cached_property
    def _targets(self) -> list[list[int]]:
        """Each source's target at each segment's start, in units of ``1 / total`` (Python ints:
        past 2^63 for long epochs)."""
        found = [[0] * self.sources]
        for weights, start, stop in zip(self.scaled, self.bounds, self.bounds[1:], strict=False):
            found.append([t + w * (stop - start) for t, w in zip(found[-1], weights, strict=True)])
        return found

    @cached_property
    def _bounds(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.bounds, np.int64)

    @cached_property
    def _weights(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.scaled, np.int64)


def stride_for(sources: int, samples: int) -> int:
    """The power of two at or below ``STEPS / sources``, ``MIN_STRIDE`` at least (one source: the
    epoch, it needs no mark)."""
    if sources < 2:
        return max(samples, 1)
    return max(MIN_STRIDE, 1 << ((STEPS // sources).bit_length() - 1))


def held_bytes(samples: int, sources: int) -> int:
    """What one epoch's marks hold (NOTE [ Epoch marks ]): a byte a source every stride positions,
    the cursors, and the objects around them."""
    rows = -(-samples // stride_for(sources, samples))
    return rows * sources + CURSORS * 16 * sources + 4096


@dataclass(frozen=True)
class State:
    """Where the walk stands before ``position``: each source's deficit and draws in the epoch."""

    position: int
    deficit: npt.NDArray[np.int64]
    drawn: npt.NDArray[np.int64]

    def copy(self) -> State:
        return State(self.position, self.deficit.copy(), self.drawn.copy())


def walk(
    rule: Rule,
    state: State,
    stop: int,
    outputs: tuple[npt.NDArray[np.uint16], npt.NDArray[np.int32]] | None = None,
    marks: npt.NDArray[np.int8] | None = None,
) -> State:
    """Walk from ``state`` to ``stop``, filling ``outputs`` (each position's source and draw) and
    ``marks`` where given; returns the state at ``stop`` (``state`` is left as it was)."""
    at = state.copy()
    chosen, draw = outputs if outputs is not None else (_NO_SOURCES, _NO_DRAWS)
    if rule.in_c:
        assert _mixture is not None
        kept = marks if marks is not None else _NO_MARKS
        _mixture.walk(
            chosen, draw, kept, rule.stride, at.position, stop, rule._bounds, rule._weights,
            rule.total, rule.sources, at.deficit, at.drawn,
        )  # fmt: skip
        return State(stop, at.deficit, at.drawn)
    deficit, drawn = at.deficit.tolist(), at.drawn.tolist()
    _walk_here(rule, at.position, stop, deficit, drawn, outputs, marks)
    return State(stop, np.asarray(deficit, np.int64), np.asarray(drawn, np.int64))


_NO_SOURCES = np.empty(0, np.uint16)
_NO_DRAWS = np.empty(0, np.int32)
_NO_MARKS = np.empty(0, np.int8)


def _walk_here(
    rule: Rule,
    first: int,
    stop: int,
    deficit: list[int],
    drawn: list[int],
    outputs: tuple[npt.NDArray[np.uint16], npt.NDArray[np.int32]] | None,
    marks: npt.NDArray[np.int8] | None,
) -> None:
    """``walk`` in Python: the reference the C walk is tested against."""
    sources, total, bounds, stride = rule.sources, rule.total, rule.bounds, rule.stride
    slack = 2 * sources - 2
    """A source is eligible once its deficit reaches ``1 / slack``."""
    segment = min(max(bisect.bisect_right(bounds, first) - 1, 0), len(rule.scaled) - 1)
    for j in range(first, stop):
        while segment + 1 < len(rule.scaled) and j >= bounds[segment + 1]:
            segment += 1
        if marks is not None and j % stride == 0:
            q = [d // total for d in deficit]
            if min(q) < -128 or max(q) > 127:
                raise ValueError("walk: a deficit left int8 marks' range")
            marks[j // stride] = q
        weights = rule.scaled[segment]
        best, key = -1, (0, 0)
        for s in range(sources):
            before = deficit[s]
            deficit[s] += weights[s]
            if deficit[s] * slack < total:
                continue  # not eligible
            # Its deadline, (1 - 1/slack - before) / weight, as a fraction; a weight of 0 (a
            # deficit left from before a change) comes last.
            mine = (slack * (total - before) - total, slack * weights[s])
            if best < 0 or _earlier(mine, key):
                best, key = s, mine
        deficit[best] -= total
        if outputs is not None:
            outputs[0][j - first], outputs[1][j - first] = best, drawn[best]
        drawn[best] += 1


def _earlier(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """``a[0] / a[1] < b[0] / b[1]``, a zero denominator meaning infinitely late."""
    if a[1] == 0:
        return False
    if b[1] == 0:
        return True
    return a[0] * b[1] < b[0] * a[1]


class EpochMarks:
    """One epoch's order by the rule of NOTE [ Mixture order ], held as NOTE [ Epoch marks ]: each
    position's source and draw computed when asked for."""

    def __init__(self, rule: Rule, marks: npt.NDArray[np.int8], counts: tuple[int, ...]) -> None:
        self.rule = rule
        self.marks = marks
        self.counts = counts
        """Each source's positions in the epoch."""
        self._cursors: list[State] = []

    @classmethod
    def choose(cls, rule: Rule, going: Going) -> EpochMarks | None:
        """Walk the whole epoch once, keeping its marks; None if ``going`` turned false first."""
        samples, sources = rule.samples, rule.sources
        if sources < 2:
            return cls(rule, np.zeros((1, 1), np.int8), (samples,))
        marks = np.zeros((-(-samples // rule.stride), sources), np.int8)
        state = State(0, np.zeros(sources, np.int64), np.zeros(sources, np.int64))
        while state.position < samples:
            if not going():
                return None
            state = walk(rule, state, min(state.position + CHUNK, samples), marks=marks)
        marks.setflags(write=False)
        return cls(rule, marks, tuple(int(c) for c in state.drawn))

    def window(self, start: int, stop: int) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.int32]]:
        """The source and the draw (in the epoch) of each position of ``[start, stop)``."""
        if self.rule.sources < 2:
            return np.zeros(stop - start, np.uint16), np.arange(start, stop, dtype=np.int32)
        begin = self._nearest(start)
        chosen = np.empty(stop - begin.position, np.uint16)
        draw = np.empty(stop - begin.position, np.int32)
        self._keep(walk(self.rule, begin, stop, (chosen, draw)))
        skip = start - begin.position
        return chosen[skip:], draw[skip:]

    def drawn_at(self, position: int) -> npt.NDArray[np.int64]:
        """Each source's draws among the epoch's first ``position`` positions."""
        if self.rule.sources < 2:
            return np.asarray([position], np.int64)
        state = walk(self.rule, self._nearest(position), position)
        self._keep(state)
        return state.drawn

    def lookup(self, positions: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each position's source and draw: one window over them all where it is no longer than a
        stride per position (a batch of a rank: its positions, ``world_size`` apart), else one per
        run of positions less than a stride apart. Either way at most a stride walked per position."""
        if not positions.size:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= self.rule.samples:
            raise ValueError(f"positions outside the epoch's {self.rule.samples}")
        if high - low <= positions.size * self.rule.stride:
            chosen, drawn = self.window(low, high + 1)
            return chosen[positions - low].astype(np.int64), drawn[positions - low].astype(np.int64)
        order = np.argsort(positions, kind="stable")
        ranked = positions[order]
        cuts = np.flatnonzero(np.diff(ranked) > self.rule.stride) + 1
        source = np.empty(positions.shape, np.int64)
        draw = np.empty(positions.shape, np.int64)
        for first, last in zip([0, *cuts.tolist()], [*cuts.tolist(), ranked.size], strict=True):
            run = ranked[first:last]
            start = int(run[0])
            chosen, drawn = self.window(start, int(run[-1]) + 1)
            source[order[first:last]] = chosen[run - start]
            draw[order[first:last]] = drawn[run - start]
        return source, draw

    def _nearest(self, position: int) -> State:
        """The state nearest before ``position`` to walk on from: a mark, or where a window ended."""
        mark = min(position // self.rule.stride, len(self.marks) - 1) * self.rule.stride
        ahead = [c for c in self._cursors if mark < c.position <= position]
        if ahead:
            return max(ahead, key=lambda c: c.position)
        return self.rule.state_at(mark, self.marks)

    def _keep(self, state: State) -> None:
        self._cursors = [state, *(c for c in self._cursors if c.position != state.position)][:CURSORS]


@dataclass(frozen=True)
class EpochDraws:
    """One epoch's sources, position by position, whole: the reference the service's marks are
    tested against (it holds marks, NOTE [ Epoch marks ])."""

    source: npt.NDArray[np.uint16]
    """The source of each position."""
    draw: npt.NDArray[np.int32]
    """Each position's draw of its source inside this epoch: 0 for its first, 1 for its second..."""
    counts: tuple[int, ...]
    """Each source's positions in the epoch."""


def epoch_draws(samples: int, segments: Segments) -> EpochDraws:
    """The sources of ``samples`` positions by the rule of NOTE [ Mixture order ]; ``segments``:
    weights from positions of the epoch on, the first at 0. O(samples x sources) each call."""
    rule = Rule.of(samples, segments)
    chosen = np.zeros(samples, np.uint16)
    draw = np.arange(samples, dtype=np.int32)  # one source: its draws are the positions
    counts: tuple[int, ...] = (samples,)
    if rule.sources > 1:
        zero = np.zeros(rule.sources, np.int64)
        counts = tuple(walk(rule, State(0, zero, zero), samples, (chosen, draw)).drawn.tolist())
    chosen.setflags(write=False)
    draw.setflags(write=False)
    return EpochDraws(chosen, draw, counts)


class _Shelf:
    """Epochs' marks by their rule (the epoch's length and weights): one held by any order alive
    is shared by every order of the same rule, ``RECENT_ORDERS`` more are kept, and the counts of
    ``KEPT_COUNTS``. Both threads that choose (the chooser, a caller's) may ask at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: weakref.WeakValueDictionary[Rule, EpochMarks] = weakref.WeakValueDictionary()
        self._recent: OrderedDict[Rule, EpochMarks] = OrderedDict()
        self._counts: OrderedDict[Rule, tuple[int, ...]] = OrderedDict()

    def known(self, rule: Rule) -> EpochMarks | None:
        with self._lock:
            return self._live.get(rule)

    def marks(self, rule: Rule, going: Going) -> EpochMarks | None:
        """The rule's marks, walked here if nobody holds them; None if ``going`` turned false."""
        found = self.known(rule)
        if found is None:
            found = EpochMarks.choose(rule, going)
            if found is None:
                return None
        with self._lock:
            found = self._live.setdefault(rule, found)
            _remember(self._recent, rule, found, RECENT_ORDERS)
            _remember(self._counts, rule, found.counts, KEPT_COUNTS)
        return found

    def counts(self, rule: Rule, going: Going) -> tuple[int, ...] | None:
        with self._lock:
            counts = self._counts.get(rule)
        if counts is not None:
            return counts
        marks = self.marks(rule, going)
        return None if marks is None else marks.counts

    def known_counts(self, rule: Rule) -> tuple[int, ...] | None:
        with self._lock:
            return self._counts.get(rule)


def _remember(recent: OrderedDict[Rule, T], rule: Rule, value: T, keep: int) -> None:
    recent[rule] = value
    recent.move_to_end(rule)
    while len(recent) > keep:
        recent.popitem(last=False)


SHELF = _Shelf()
