"""How many decode workers take tasks: ``--workers auto`` (NOTE [ Sizing workers ]). Pure: the
service feeds it totals every quarter second (``controller.py``) and applies what it decides.

NOTE [ Sizing workers ]
    With ``--workers auto`` the service may run up to ``worker_processes`` workers (four per core of
    the CPU budget, NOTE [ CPU budget ]) and lets ``active`` of them take tasks, one per core at
    first; more are forked from the template when it asks (NOTE [ Workers from a template ] in
    supervisor/workers/pool.py), in milliseconds, and those it lets go are parked, so a change takes
    effect at once. Over each window it measures
    * ``demand``: its trainers' ``(waited + computed) / computed`` over the window (their
      heartbeats, NOTE [ Exposed wait ]), each wait counted only while the service saw the trainer
      starved, weighted by the batches each took (NOTE [ Fleet load ]); 1.0: nobody waited;
    * ``busy``: the active workers' share of the window spent on tasks;
    * ``cost``: the cores a worker on a task takes or waits for, per second (its CPU time and its
      time runnable in the run queue: on a busy machine a computing worker still costs a core);
      a worker waiting on a store or on a pipeline's own waits costs little, so such a feed may
      run more workers than cores; one above ``CPU_BOUND`` counts as a whole core;
    * ``rate``: images decoded per second.
    and decides:
    1. Trainers wait (``demand > WAITING``) and the workers are busy at least ``ADD_BUSY`` of the
       time (a feed of short tasks never looks fully busy: measured, 2 workers of a pipeline that
       sleeps 10 ms a sample spent 45-60 % of their time on tasks while the trainer waited, and 8
       delivered 2.8x as much): add, jumping to
       ``ceil(active * demand)``, the count the wait calls for if each new worker adds what the
       current ones do, at most ``JUMP`` times the count, within the CPU budget at the measured cost
       (``active * cost <= budget``) and the workers started.
    2. Nobody waits: never add (the trainers, not the data, are the bottleneck). Calm (``demand
       <= CALM``, below ``WAITING``: a demand at the threshold neither adds nor removes) with the
       workers idle (``busy < IDLE``) in every window of the last settle time since the count
       last changed: remove down to the most any of them needed at ``BUSY``. So a count stands
       at least the settle time before it goes down, and a wait that comes and goes faster keeps
       it (before, a trainer's claims made a service start all its workers and undo them every
       ~10 s; trainers that waited in turns for 2, 10, 20 or 60 s made 23 to 76 changes in ten
       minutes, tests/unit/test_sizing_rules.py). The settle time is ``SETTLE`` seconds, doubled
       (up to ``MAX_SETTLE``) each time workers are added again within ``REGRET`` seconds of a
       removal: trainers whose wait keeps coming back keep their workers, as a
       HorizontalPodAutoscaler's scale-down stabilization would.
    3. Trainers wait but the workers idle (``busy < ADD_BUSY``): they wait for something else
       (credits, the network, their own host): hold. Rule 4 undoes an addition made in error.
    4. The window after an addition checks its gain: a rate that rose by less than ``GAIN`` of what
       the new workers promised (memory bandwidth, a store's own limit, a CPU neighbour) undoes
       the step, and the count is held for ``HOLD`` windows, twice as long for each undo in a row
       (up to ``2 ** BACKOFF`` times: a wait more workers do not answer stops being chased;
       measured, a loop that only pulls on a busy 2-core host had 2 workers made 8 and undone,
       at 48 % of the gain promised, every ~10 s). So does a step after which the trainers' own
       compute per batch (their heartbeats' computed time over batches pulled: the median of the
       trainers', each counted by the batches it took here, so one trainer's word moves it only
       if it takes most of them) grew by more than ``SLOWER``: the new workers took CPU the
       trainers needed (a trainer computing on the same host), and a faster feed to slower
       trainers is no gain. A step shorter than ``MIN_STEP`` is not compared: a loop that
       computes about nothing measures its own bookkeeping. A window in which nobody waits is no
       test of the rate: the trainers took what they wanted (rule 2 removes what they then do
       not need).
    With no trainer attached it holds (a warm start's few batches say nothing of the next trainer),
    and its first window starts when one attaches. That window ends as soon as the trainers are seen
    waiting, after ``FIRST`` seconds rather than ``SHORT`` (a trainer's second heartbeat comes a
    quarter of a second after it attaches: NOTE [ Early heartbeat ] in gpu_worker/heartbeats.py),
    so a trainer that attaches to an idle service gets workers within a second; the rules are
    the same, so a CPU-bound feed at its budget still adds nothing, and the next window checks the
    gain. It holds likewise while a worker taking tasks is still
    booting or warming up (the service's start, an addition, a replacement: ``all_active_ready``),
    whose window would measure the boot. A parked worker's CPU is never counted.
    A window is ``SHORT`` seconds after a change or while trainers wait, and ``LONG`` once the
    count has settled and nobody waits, so it moves fast when it must and is quiet otherwise. In a
    fleet each service sizes itself on its own trainers' waits and its own workers, while the
    trainers' fleet pass shares batches by measured pace: a service that adds workers delivers
    faster and is given more, which is what it added them for; the undo rule stops a service that
    gains nothing from chasing the fleet pass's shift.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.status import SizingDecision, SizingStatus, SizingWindow

log = logging.getLogger(__name__)

BUSY = 0.85
IDLE = 0.6
ADD_BUSY = 0.4
WAITING = 1.1
"""Demand above which trainers count as waiting: a tenth of their time blocked on data."""
CALM = 1.05
"""Demand at or below which nobody counts as waiting, for a removal; between it and ``WAITING``
the count holds, so a demand at the threshold does not add and remove in turn."""
SETTLE = 10.0
"""Seconds of calm windows, since the count last changed, before it goes down: a claim that comes
and goes faster than this keeps the workers rather than making them come and go."""
MAX_SETTLE = 160.0
"""The longest the settle time grows to, for trainers that keep waiting again soon after a removal."""
REGRET = 60.0
"""Seconds after a removal within which an addition shows it came too soon (the settle time doubles)."""
JUMP = 4.0
GAIN = 0.5
SLOWER = 1.2
"""A step after which the trainers' compute per batch grew by more than this factor is undone."""
MIN_STEP = 0.02
"""Seconds of compute per batch below which a step is not compared (both sides count as this): a
loop that computes about nothing (one bound on data, a benchmark) measures only its own
bookkeeping between pulls, which a busy host moves by more than ``SLOWER`` (measured: a loop that
only listed each batch's indices computed 8 ms a batch by its heartbeats on a busy 2-core host).
GPU training steps are longer, and a trainer this quick waits on data, which rule 4's rate check
covers."""
HOLD = 3
BACKOFF = 3
"""An undo in a row doubles the hold, up to ``2 ** BACKOFF`` times ``HOLD`` windows."""
SHORT = 2.0
LONG = 10.0
FIRST = 0.5
"""Seconds the first window after trainers attach lasts at least, if they wait (NOTE [ Sizing workers ])."""
MIN_COST = 0.05
"""Cores a worker is taken to cost at least: a worker that seems free is never free."""
CPU_BOUND = 0.5
"""CPU per second on a task above which a worker counts as a whole core (NOTE [ Sizing workers ])."""
DECISIONS = 8
"""Decisions kept for ``status``."""


@dataclass(frozen=True)
class Sample:
    """Running totals at one moment."""

    at: float
    on_tasks: float
    """Seconds the workers have spent on tasks."""
    cpu: float
    """CPU seconds the workers have used."""
    images: int
    """Images decoded."""


@dataclass(frozen=True)
class Window:
    seconds: float
    busy: float
    cost: float
    rate: float
    demand: float
    step: float | None = None
    """The trainers' compute per batch pulled, in seconds; None before they pulled any."""

    def describe(self) -> str:
        step = "" if self.step is None else f", their step {self.step * 1000:.0f} ms"
        return (
            f"trainers' demand {self.demand:.2f}{step}, workers busy {self.busy:.0%}, "
            f"{self.cost:.2f} cores each, {self.rate:.0f} images/s"
        )


@dataclass(frozen=True)
class Decision:
    at: float
    before: int
    after: int
    reason: str


@dataclass
class Sizer:
    """Decides ``active`` (NOTE [ Sizing workers ]); ``tick`` returns a new count or None."""

    active: int
    most: int
    """The most workers that can be active (``--max-workers``, or four per core of the budget)."""
    budget: float
    """Cores the workers may use together (NOTE [ CPU budget ])."""
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=DECISIONS))
    _base: Sample | None = None
    _window: float = SHORT
    _added: tuple[int, float, float | None] | None = None
    """After an addition: (count, rate and trainers' step before it), checked by the next window."""
    _hold: int = 0
    _undone: int = 0
    """Undos in a row: each doubles the hold (``BACKOFF``)."""
    _calm: tuple[float, int] | None = None
    """Since when the windows have been calm with the workers idle, and the most any needed."""
    _settle: float = SETTLE
    """Seconds of calm before a removal (rule 2)."""
    _removed_at: float = -math.inf
    """When rule 2 last removed workers."""
    _first: bool = True
    """The window runs from when trainers attached to a service that had none: it may end early."""
    last: Window | None = None

    def tick(
        self,
        sample: Sample,
        demand_since: Callable[[float], float],
        trainers: int = 1,
        step_since: Callable[[float], float | None] = lambda since: None,
    ) -> int | None:
        """Take the totals now; ``demand_since(t)`` is the trainers' demand from ``t`` on
        (NOTE [ Fleet load ]), ``step_since(t)`` their compute per batch. A new count, or None."""
        base = self._base
        if not trainers:  # nothing to size for; the first window starts when a trainer attaches
            self._base, self._first = sample, True
            return None
        if base is None:
            self._base = sample
            return None
        elapsed = sample.at - base.at
        if elapsed < (FIRST if self._first else SHORT):
            return None
        demand = demand_since(base.at)
        if elapsed < (SHORT if self._first else self._window) and demand <= WAITING:
            return None  # nobody waits: the window runs on
        self._base, self._first = sample, False
        window = _measure(base, sample, self.active, demand, step_since(base.at))
        self.last = window
        after, reason = self._decide(window, sample.at)
        if after == self.active:
            self._window = LONG
            return None
        self.decisions.append(Decision(sample.at, self.active, after, reason))
        log.info("decode workers %d -> %d: %s", self.active, after, reason)
        self.active, self._window, self._calm = after, SHORT, None
        return after

    def _decide(self, w: Window, now: float) -> tuple[int, str]:
        if self._added is not None:
            undone = self._check_gain(w)
            if undone is not None:
                return undone
        waits = w.demand > WAITING and w.busy >= ADD_BUSY
        need = self._settled_need(w, now)
        if self._hold:
            self._hold -= 1
            return self.active, "holding"
        if waits:
            return self._add(w, now)
        if need is not None and need < self.active:
            self._removed_at = now
            return need, f"no trainer waits and the workers idle for {self._settle:.0f} s: {w.describe()}"
        return self.active, "steady"

    def _settled_need(self, w: Window, now: float) -> int | None:
        """Rule 2: the most workers the calm windows needed at ``BUSY``, once they have run for
        the settle time; None before, and while a window is not calm."""
        if w.demand > CALM or w.busy >= IDLE:
            self._calm = None
            return None
        need = max(1, math.ceil(self.active * w.busy / BUSY))
        since, most = self._calm or (now - w.seconds, need)
        self._calm = (since, max(most, need))
        return self._calm[1] if now - since >= self._settle else None

    def _add(self, w: Window, now: float) -> tuple[int, str]:
        wanted = math.ceil(self.active * min(w.demand, JUMP))
        # A worker that computes for most of its task would take a whole core if it could: on a
        # busy machine it gets less and looks cheaper than it is.
        per_worker = 1.0 if w.cost >= CPU_BOUND else max(w.cost, MIN_COST)
        affordable = math.floor(self.budget / per_worker + 1e-9)
        after = max(self.active, min(wanted, affordable, self.most))
        if after == self.active:
            return self.active, "at the CPU budget or the workers started"
        self._added = (self.active, w.rate, w.step)
        if now - self._removed_at < REGRET:  # the last removal came too soon: wait longer next time
            self._settle = min(2 * self._settle, MAX_SETTLE)
        return after, f"trainers wait: {w.describe()}"

    def _check_gain(self, w: Window) -> tuple[int, str] | None:
        """The window after an addition: undo it if it gained too little."""
        assert self._added is not None
        before, rate, step = self._added
        self._added = None
        if step is not None and w.step is not None and _slower(step, w.step):
            slower = f"{step * 1000:.0f} -> {w.step * 1000:.0f} ms"
            return self._undo(before, f"the trainers' step got slower after it ({slower})")
        promised = rate / before * (self.active - before) if before else 0.0
        # A window in which nobody waits took what the trainers wanted: its rate says nothing of
        # what the workers could give (and alternating claims would undo every addition).
        if promised <= 0 or w.rate - rate >= GAIN * promised or w.demand <= WAITING:
            self._undone = 0
            return None
        gained = f"{w.rate - rate:+.0f} images/s of {promised:.0f} expected"
        return self._undo(before, f"the last step gained little ({gained})")

    def _undo(self, before: int, why: str) -> tuple[int, str]:
        """Back to ``before``, held ``HOLD`` windows, twice as long for each undo in a row."""
        self._hold = HOLD * 2 ** min(self._undone, BACKOFF)
        self._undone += 1
        return before, f"{why}: undone, held for {self._hold} windows"

    def status(self, now: float, started: int) -> SizingStatus:
        """What ``status`` shows of the sizing, with the workers ``started`` so far."""
        w = self.last
        window = (
            None
            if w is None
            else SizingWindow(
                busy=round(w.busy, 3),
                cost=round(w.cost, 3),
                rate=round(w.rate, 1),
                demand=round(w.demand, 3),
                step_ms=None if w.step is None else round(w.step * 1000, 1),
            )
        )
        decisions = tuple(
            SizingDecision(seconds_ago=round(now - d.at, 1), before=d.before, after=d.after, reason=d.reason)
            for d in self.decisions
        )
        return SizingStatus(mode="auto", active=self.active, started=started, most=self.most,
                            budget=round(self.budget, 2), window=window, decisions=decisions)  # fmt: skip


def _slower(before: float, after: float) -> bool:
    """Did the trainers' step grow by more than ``SLOWER``? Steps under ``MIN_STEP`` count as it."""
    return max(after, MIN_STEP) > SLOWER * max(before, MIN_STEP)


def _measure(base: Sample, now: Sample, active: int, demand: float, step: float | None) -> Window:
    seconds = now.at - base.at
    capacity = seconds * active
    on_tasks = now.on_tasks - base.on_tasks
    return Window(
        seconds,
        busy=min(1.0, max(0.0, on_tasks / capacity)),
        cost=max(0.0, (now.cpu - base.cpu) / (on_tasks if on_tasks > 0 else capacity)),
        rate=max(0.0, (now.images - base.images) / seconds),
        demand=demand,
        step=step,
    )
