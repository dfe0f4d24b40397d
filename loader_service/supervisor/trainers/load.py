"""The load a scaler reads: how much of this service's decoding its trainers would use.

NOTE [ Fleet load ]
    A scaler that adds services when their CPUs are busy adds them when the trainer, not the data,
    is the bottleneck (busy decoders that are ahead help nobody); one that follows only the
    trainers' wait never removes any. So each service exports, over the last ``WINDOW`` seconds:
    * ``busy``: the share of its decode workers' time spent on tasks (1.0: each always had one);
    * ``demand``: for each trainer attached, ``(waited + computed) / computed`` from its heartbeats
      (NOTE [ Exposed wait ] in gpu_worker/loop_clock.py): a trainer that waits half its time
      would step twice as often if its data were there at once, so it asks for twice the data.
      1.0 for one that never waits; at most ``MAX_DEMAND`` (a trainer that computed nothing in
      the window waits for all of it). The service's is its trainers' demands weighted by the
      batches each was announced here over the window;
    * ``load = busy * demand``: the decode capacity its trainers ask for, in multiples of what it
      has. 0.5: half its workers would do; 2.0: twice as many services would.
    A HorizontalPodAutoscaler that keeps the fleet's mean load at a target ``t`` (0.8 keeps a fifth
    spare) sets ``ceil(replicas * mean load / t)`` replicas, its own rule: more while trainers
    wait, fewer while workers idle and no trainer waits, none added while trainers do not wait
    however busy the workers are.
    A trainer's heartbeats are its own word, so they count only as far as the service saw them
    (measured before: one trainer that pulled nothing and claimed it waited 100 s a second raised
    the load from 0.24-0.46 to 3.7-4.4, about ten times the pods needed). At every housekeeping
    round (``Attachments.watch_waits``) the service notes whether each trainer is in an epoch here and,
    if so, whether it is ``starved``: a credit free and the batch it asked for next (a picked run:
    any it named) not ready. A trainer waits on this service's data only then. So, over a window:
    * its wait counts at most the seconds it was seen starved, and its compute at least the rest
      of its seconds in an epoch (it had its batches: whatever it did then, it did not wait for
      decoding, and more services would not help it);
    * one that was announced no batch here has no demand (1.0): it pulls nothing from this service;
    * the service's demand is the trainers' weighted by the batches each was announced here, so
      one trainer moves it by its share of them at most, ``share * (MAX_DEMAND - 1)``, and only as
      far as the service really could not keep up with it. A trainer that takes every batch as
      soon as it is ready, computing nothing, is starved and takes them: that is demand, not a lie.
    What it cannot tell: a trainer that waits on its own host while the service also lags counts
    that wait; time in an epoch outside the loop (an evaluation mid-epoch) counts as compute,
    which lowers the demand (those batches were not waited for). Figures a peer sends are bounded:
    a heartbeat's totals that go backwards (a restarted loader) start its window again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from protocol.messages import Heartbeat
from protocol.status import LoadStatus

WINDOW = 10.0
"""Seconds the load is measured over."""
MAX_DEMAND = 10.0
"""The most a single trainer's wait can multiply the load by."""
MAX_SAMPLES = 64
"""Samples kept per trainer or for the workers (a heartbeat each; several per second at most)."""


@dataclass
class Totals:
    """Running totals sampled over time; ``change`` gives their growth over the last ``WINDOW``."""

    _samples: deque[tuple[float, ...]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, now: float, *totals: float) -> None:
        if self._samples and any(new < old for new, old in zip(totals, self._samples[-1][1:], strict=True)):
            self._samples.clear()  # totals went backwards: a new loader or worker set
        self._samples.append((now, *totals))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW:
            self._samples.popleft()  # keep one sample at least WINDOW old as the base

    def change(self, since: float | None = None) -> tuple[float, ...] | None:
        """(seconds, growth of each total) over the window kept, or from the last sample taken at
        or before ``since``."""
        kept = list(self._samples)
        if since is not None:
            kept = kept[max(0, sum(1 for sample in kept if sample[0] <= since) - 1) :]
        if len(kept) < 2:
            return None
        first, last = kept[0], kept[-1]
        if last[0] <= first[0]:
            return None
        return tuple(b - a for a, b in zip(first, last, strict=True))


class Seen(NamedTuple):
    """What one trainer's figures grew by over a window: its heartbeats' word and the service's."""

    waited: float
    computed: float
    pulls: float
    in_epoch: float
    """Seconds the service saw it in an epoch here (NOTE [ Fleet load ])."""
    starved: float
    """Of them, seconds it saw it starved."""
    announced: float
    """Batches announced to it."""


@dataclass
class TrainerLoop:
    """One trainer's loop as its heartbeats tell it and as this service saw it (NOTE [ Fleet load ])."""

    totals: Totals = field(default_factory=Totals)
    """At each heartbeat, the running totals a ``Seen`` is the growth of."""
    in_epoch: float = 0.0
    starved: float = 0.0
    _watched: tuple[float, bool | None] | None = None
    """When it was last looked at, and what it was then: starved, fed, or (None) in no epoch."""

    def watch(self, now: float, starved: bool | None) -> None:
        """What it is now (``status.starved``): the time since the last look counts as what it was then."""
        if self._watched is not None and self._watched[1] is not None:
            seconds = now - self._watched[0]
            self.in_epoch += seconds
            self.starved += seconds if self._watched[1] else 0.0
        self._watched = (now, starved)

    def heard(self, now: float, beat: Heartbeat, announced: int) -> None:
        """A heartbeat's totals, with what the service saw by ``now``."""
        self.watch(now, None if self._watched is None else self._watched[1])
        waited, computed = beat.waited / 1000, beat.computed / 1000
        self.totals.add(now, waited, computed, beat.pulls, self.in_epoch, self.starved, announced)

    def seen(self, since: float | None = None) -> Seen | None:
        """Its figures over the window (or from ``since``); None if it took no batch here meanwhile
        (they say nothing of this service)."""
        change = self.totals.change(since)
        return None if change is None or change[-1] <= 0 else Seen(*change[1:])

    def demand(self, since: float | None = None) -> float:
        """Its demand over the window (or from ``since``); 1.0 until it has reported, or if it took
        no batch here."""
        seen = self.seen(since)
        return 1.0 if seen is None else demand(seen)


def demand(seen: Seen) -> float:
    """``(waited + computed) / computed``, its wait at most the time the service saw it starved and
    its compute at least the rest of its time in an epoch (NOTE [ Fleet load ])."""
    waited = min(seen.waited, seen.starved)
    computed = max(seen.computed, seen.in_epoch - seen.starved)
    if waited <= 0:
        return 1.0
    if computed <= 0:
        return MAX_DEMAND
    return min(MAX_DEMAND, (waited + computed) / computed)


def weighted_demand(loops: Iterable[TrainerLoop], since: float | None = None) -> float:
    """The service's demand: its trainers', each weighted by the batches it was announced here
    (NOTE [ Fleet load ]); 1.0 if none took any."""
    taken = weighted = 0.0
    for loop in loops:
        seen = loop.seen(since)
        if seen is not None:
            taken, weighted = taken + seen.announced, weighted + seen.announced * demand(seen)
    return weighted / taken if taken > 0 else 1.0


def step_seconds(loops: Iterable[TrainerLoop], since: float) -> float | None:
    """The trainers' compute per batch pulled from ``since`` on: the median of theirs, each counted
    by the batches it took here, so one moves it only by taking most of them (its word is all the
    service has of its step); one that took none has no say. None until they have pulled any."""
    steps = sorted(
        (seen.computed / seen.pulls, seen.announced)
        for seen in (loop.seen(since) for loop in loops)
        if seen is not None and seen.pulls > 0
    )
    half = sum(taken for _, taken in steps) / 2
    for step, taken in steps:
        half -= taken
        if half <= 0:
            return step
    return None


def busy(workers: Totals) -> float:
    """The workers' share of time on tasks over the window (totals: seconds on tasks, and seconds
    of workers there were to take them)."""
    change = workers.change()
    if change is None:
        return 0.0
    _, on_tasks, capacity = change
    return 0.0 if capacity <= 0 else min(1.0, on_tasks / capacity)


@dataclass(frozen=True)
class Load:
    busy: float
    demand: float

    @property
    def load(self) -> float:
        return self.busy * self.demand

    def status(self) -> LoadStatus:
        return LoadStatus(load=round(self.load, 3), busy=round(self.busy, 3), demand=round(self.demand, 3))


@dataclass
class WorkerTime:
    """The decode workers' time on tasks against the time of workers there were, sampled about once
    a second by the main loop."""

    totals: Totals = field(default_factory=Totals)
    capacity: float = 0.0
    """Worker-seconds there have been to take tasks."""
    at: float | None = None

    def sample(self, now: float, busy_seconds: float, workers: int) -> None:
        if self.at is not None:
            self.capacity += (now - self.at) * workers
        self.at = now
        self.totals.add(now, busy_seconds, self.capacity)


def measure(workers: WorkerTime, loops: Iterable[TrainerLoop]) -> Load:
    """This service's load over the window (NOTE [ Fleet load ])."""
    return Load(busy(workers.totals), weighted_demand(loops))
