"""The trainers' series of the service's metrics: one per trainer and feed, never one per session.

NOTE [ Trainer series ]
    A session id names one connection, not a trainer: a trainer that reconnects after its session
    timed out or the service restarted gets a new one, and every session of a job that comes and
    goes is another. Labelled by it, the series were new each time and Prometheus kept each (five
    rounds of 100 sessions: 2,000 series). So a trainer's series are labelled ``{client, feed}``
    only: ``client`` is the name its hello gives (``ServiceLoader``'s ``host:pid``, one per trainer
    process, escaped: NOTE [ Chosen names are shown as text ]), and its sessions on one feed are
    one series: their lag, credits and leased batches summed, their demand, asked shares and passes
    the largest, their rows served counted on (each figure's rule is declared with it, NOTE
    [ Status contract ]).
    - Live series are bounded: each family has at most one series per session the status lists
      (NOTE [ A status fits one frame ]: at most ``STATUS_SESSIONS``, 100), and the three by source
      that many times the feed's sources (``MAX_SOURCES``).
    - A trainer that is gone leaves no series: each scrape is built from the last snapshot, so its
      series end there (Prometheus marks them stale); a trainer that comes back under the same name
      (the same process, reconnected) continues them.
    - Rows served stay a counter: each listed session adds what its own count grew since the last
      snapshot, so a session that ends takes nothing back from its trainer's count (a sum over the
      live sessions would fall, and ``rate()`` would read that as a reset and count everything
      again). A trainer with no session listed is forgotten, and starts from 0 if it comes back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from protocol.status import Sample

Series = dict[str, dict[tuple[str, ...], float]]
"""Metric name -> label values -> value."""
CountedKey = tuple[str, tuple[str, ...]]
"""(metric name, label values): one trainer's counter."""


class Counted:
    """The counters a trainer's sessions add to, counted on over sessions that come and go
    (NOTE [ Trainer series ])."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, CountedKey], float] = {}
        """(session id, counter) -> the session's count at the last body."""
        self.totals: dict[CountedKey, float] = {}

    def update(self, given: Iterable[Sample]) -> dict[CountedKey, float]:
        """Count what each listed session's counts grew; the totals of the trainers listed now."""
        seen: dict[tuple[str, CountedKey], float] = {}
        totals: dict[CountedKey, float] = {}
        for sample in given:
            if sample.metric.combine != "counted":
                continue
            key = (sample.metric.name, tuple(value for _, value in sample.labels))
            grown = max(0.0, sample.value - self._seen.get((sample.session, key), 0.0))
            totals[key] = totals.get(key, self.totals.get(key, 0.0)) + grown
            seen[(sample.session, key)] = sample.value
        self._seen, self.totals = seen, totals
        return totals


def series(given: Iterable[Sample], counted: Mapping[CountedKey, float]) -> Series:
    """Each metric's series from a body's samples: one a label set, a trainer's sessions summed or
    their largest taken, its counters as ``Counted`` made them."""
    out: Series = {}
    for sample in given:
        values = out.setdefault(sample.metric.name, {})
        at = tuple(value for _, value in sample.labels)
        combine = sample.metric.combine
        if combine == "counted":
            values[at] = counted.get((sample.metric.name, at), 0.0)
        elif combine == "sum" and at in values:
            values[at] += sample.value
        elif combine == "largest" and at in values:
            values[at] = max(values[at], sample.value)
        else:
            values[at] = sample.value
    return out
