"""The trainers' series of the service's metrics: one per trainer and feed, never one per session.

NOTE [ Trainer series ]
    A session id names one connection, not a trainer: a trainer that reconnects after its session
    timed out or the service restarted gets a new one, and every session of a job that comes and
    goes is another. Labelled by it, the series were new each time and Prometheus kept each (five
    rounds of 100 sessions: 2,000 series). So a trainer's series are labelled ``{client, feed}``
    only: ``client`` is the name its hello gives (``ServiceLoader``'s ``host:pid``, one per trainer
    process, escaped: NOTE [ Chosen names are shown as text ]), and its sessions on one feed are
    one series: their lag, credits and leased batches summed, their demand, asked shares and passes
    the largest, their rows served counted on.
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

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

TRAINER_LABELS = ("client", "feed")
Trainer = tuple[str, str]
"""(client, feed): what a trainer's series are labelled with."""
ServedKey = tuple[str, str, str]
"""(client, feed, source)."""

SUMMED = (
    ("lag", "dataferry_trainer_lag_batches", "Batches decoded for a trainer that it has not taken yet."),
    ("credits", "dataferry_trainer_credits", "Credits a trainer has granted."),
    ("leased", "dataferry_trainer_leased_batches", "Batches a trainer holds."),
)
LARGEST = (
    ("demand", "dataferry_trainer_loop_demand", "A trainer's (waited + computed) / computed over the last "
     "10 s, as far as the service saw it wait, its largest over its sessions (NOTE [ Exposed wait ], "
     "NOTE [ Fleet load ])."),
    ("encode_share", "dataferry_trainer_encode_ratio", "The share of a trainer's rows it decodes itself "
     "(NOTE [ Encoded rows ]), its largest over its sessions."),
)  # fmt: skip
LARGEST_BY_SOURCE = (
    (
        "asked",
        "dataferry_trainer_source_asked_ratio",
        "The share of a source a trainer's weights ask for now.",
    ),
    ("pass", "dataferry_trainer_source_pass", "A weighted job's pass over a source."),
)


class ServedRows:
    """Rows served to each trainer by source, counted on over its sessions (NOTE [ Trainer series ])."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = {}
        """session id -> source -> its count at the last snapshot."""
        self.totals: dict[ServedKey, float] = {}

    def update(self, sessions: list[Mapping[str, Any]]) -> dict[ServedKey, float]:
        """Count what each listed session's rows grew; the totals of the trainers listed now."""
        seen: dict[str, dict[str, float]] = {}
        totals: dict[ServedKey, float] = {}
        for session in sessions:
            client, feed = trainer_of(session)
            name = str(session.get("session", ""))
            before, now = self._seen.get(name, {}), seen.setdefault(name, {})
            for source, served in _by_source(session, "served"):
                key = (client, feed, source)
                grown = max(0.0, served - before.get(source, 0.0))
                totals[key] = totals.get(key, self.totals.get(key, 0.0)) + grown
                now[source] = served
        self._seen, self.totals = seen, totals
        return totals


def trainer_of(session: Mapping[str, Any]) -> Trainer:
    return str(session.get("client", "")), str(session.get("feed", ""))


def trainer_families(
    sessions: list[Mapping[str, Any]], served: Mapping[ServedKey, float]
) -> Iterator[Metric]:
    """Each trainer's series from the listed sessions and the rows counted for them."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for combine, specs in ((_sum, SUMMED), (max, LARGEST)):
        for key, name, doc in specs:
            values: dict[Trainer, float] = {}
            for session in sessions:
                if (value := _num(session.get(key))) is not None:
                    trainer = trainer_of(session)
                    values[trainer] = combine(values[trainer], value) if trainer in values else value
            yield _family(GaugeMetricFamily(name, doc, labels=TRAINER_LABELS), values.items())
    for key, name, doc in LARGEST_BY_SOURCE:
        largest: dict[ServedKey, float] = {}
        for session in sessions:
            for source, value in _by_source(session, key):
                at = (*trainer_of(session), source)
                largest[at] = max(largest.get(at, value), value)
        yield _family(GaugeMetricFamily(name, doc, labels=[*TRAINER_LABELS, "source"]), largest.items())
    doc = "Rows announced to a trainer, by source (NOTE [ Trainer series ])."
    labels = [*TRAINER_LABELS, "source"]
    yield _family(
        CounterMetricFamily("dataferry_trainer_source_served_samples", doc, labels=labels), served.items()
    )


def _family(
    family: CounterMetricFamily | GaugeMetricFamily, values: Iterable[tuple[tuple[str, ...], float]]
) -> CounterMetricFamily | GaugeMetricFamily:
    for labels, value in values:
        family.add_metric(list(labels), value)
    return family


def _by_source(session: Mapping[str, Any], key: str) -> Iterator[tuple[str, float]]:
    """(source, number) for each row of the session's ledger that has ``key`` (NOTE [ Source ledger ])."""
    rows = session.get("sources")
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, Mapping) and (value := _num(row.get(key))) is not None:
            yield str(row.get("source", "")), value


def _sum(a: float, b: float) -> float:
    return a + b


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
