"""The load a scaler reads: how much of this service's decoding its trainers would use.

NOTE [ Fleet load ]
    A scaler that adds services when their CPUs are busy adds them when the trainer, not the data,
    is the bottleneck (busy decoders that are ahead help nobody); one that follows only the
    trainers' wait never removes any. So each service exports, over the last ``WINDOW`` seconds:
    * ``busy``: the share of its decode workers' time spent on tasks (1.0: each always had one);
    * ``demand``: for each trainer attached, ``(waited + computed) / computed`` from its heartbeats
      (NOTE [ Exposed wait ] in gpu_worker/loop_clock.py): a trainer that waits half its time
      would step twice as often if its data were there at once, so it asks for twice the data.
      1.0 for one that never waits; the largest of its trainers'; at most ``MAX_DEMAND`` (a
      trainer that computed nothing in the window waits for all of it);
    * ``load = busy * demand``: the decode capacity its trainers ask for, in multiples of what it
      has. 0.5: half its workers would do; 2.0: twice as many services would.
    A HorizontalPodAutoscaler that keeps the fleet's mean load at a target ``t`` (0.8 keeps a fifth
    spare) sets ``ceil(replicas * mean load / t)`` replicas, its own rule: more while trainers
    wait, fewer while workers idle and no trainer waits, none added while trainers do not wait
    however busy the workers are. What it cannot tell: a trainer that waits for something other
    than decoding (its own network, its host's copies) raises the load too, and more services do
    not help it. Figures a peer sends are bounded: a heartbeat's totals that go backwards (a
    restarted loader) start its window again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 10.0
"""Seconds the load is measured over."""
MAX_DEMAND = 10.0
"""The most a single trainer's wait can multiply the load by."""
MAX_SAMPLES = 64
"""Samples kept per trainer or for the workers (a heartbeat each; several per second at most)."""


@dataclass
class Totals:
    """Running totals sampled over time; ``change`` gives their growth over the last ``WINDOW``."""

    _samples: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, now: float, first: float, second: float) -> None:
        if self._samples and (first < self._samples[-1][1] or second < self._samples[-1][2]):
            self._samples.clear()  # totals went backwards: a new loader or worker set
        self._samples.append((now, first, second))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW:
            self._samples.popleft()  # keep one sample at least WINDOW old as the base

    def change(self, since: float | None = None) -> tuple[float, float, float] | None:
        """(seconds, growth of the first total, growth of the second) over the window kept, or
        from the last sample taken at or before ``since``."""
        kept = list(self._samples)
        if since is not None:
            kept = kept[max(0, sum(1 for t, _, _ in kept if t <= since) - 1) :]
        if len(kept) < 2:
            return None
        (t0, a0, b0), (t1, a1, b1) = kept[0], kept[-1]
        return (t1 - t0, a1 - a0, b1 - b0) if t1 > t0 else None


def demand(loop: Totals, since: float | None = None) -> float:
    """A trainer's ``(waited + computed) / computed`` over the window (or from ``since``); 1.0
    until it has reported."""
    change = loop.change(since)
    if change is None:
        return 1.0
    _, waited, computed = change
    if waited <= 0:
        return 1.0
    if computed <= 0:
        return MAX_DEMAND
    return min(MAX_DEMAND, (waited + computed) / computed)


def step_seconds(steps: Iterable[Totals], since: float) -> float | None:
    """The trainers' compute per batch pulled from ``since`` on, all of them together (their
    ``Session.steps``); None until they have pulled any."""
    computed = pulled = 0.0
    for totals in steps:
        change = totals.change(since)
        if change is not None:
            computed, pulled = computed + change[1], pulled + change[2]
    return computed / pulled if pulled > 0 else None


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

    def status(self) -> dict[str, float]:
        return {"load": round(self.load, 3), "busy": round(self.busy, 3), "demand": round(self.demand, 3)}


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


def measure(workers: WorkerTime, loops: Iterable[Totals]) -> Load:
    """This service's load over the window (NOTE [ Fleet load ])."""
    return Load(busy(workers.totals), max((demand(loop) for loop in loops), default=1.0))
