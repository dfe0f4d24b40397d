"""The body of a ``status`` reply, declared once: what a service reports of itself, and which of it
is a Prometheus metric.

NOTE [ Status contract ]
    A status body is a ``ServiceStatus`` made into msgpack maps by ``to_body``: each record a map
    from its fields' keys to their values, nested records and rows as maps and lists. Every field
    is declared here with what it means (``plain``), or, where it is a metric, with the metric's
    name, kind and help as well (``figure``), the way ``option(...)`` declares a flag. From those
    declarations follow the service's Prometheus families (``edges/metrics.py`` walks the body
    with ``samples``), the metric list and the body's reference (docs/reference/metrics.md,
    generated) and the tests that hold the rules, dashboard and readers to the names. So a new
    per-trainer figure is three files: its field here, its value where the service builds the
    record (``edges/status.py``), and a column of ``top`` or ``status`` if it is to be seen.
    - Labels: a record's ``LABELS`` name the labels it adds to its metrics and the fields that
      give their values (a feed adds ``feed`` from its ``name``); a nested record or row carries
      the labels of those above it; a figure ``by`` a label is a map whose keys are that label.
    - Sessions are not trainers (NOTE [ Trainer series ]): a figure of a record with an
      ``IDENTITY`` (a session) says how its trainer's sessions combine: summed, the largest, or a
      counter counted on over sessions that come and go.
    - A reader never trusts a body: an older or newer service may lack a field or hold another
      type, so ``status`` and ``top`` read defensively and show a missing value as ``-``.
    - Renaming a metric keeps the old name one release (``RENAMED`` in ``edges/metrics.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar, dataclass_transform

Kind = Literal["gauge", "counter", "histogram"]
Combine = Literal["sum", "largest", "counted"]
"""How one trainer's sessions make its one series (NOTE [ Trainer series ])."""
SLOT_STATES = ("free", "filling", "ready", "leased")
"""The states of a batch slot, the keys of a feed's ``slots``."""
Labels = tuple[tuple[str, str], ...]

_KEY = "status_key"
_HELP = "status_help"
_METRIC = "status_metric"
_PART = "status_part"


@dataclass(frozen=True)
class Metric:
    """One Prometheus family: its name (a counter's without ``_total``), kind and help."""

    name: str
    kind: Kind
    help: str
    by: str = ""
    """The field is a map, each key the value of this label (a feed's slots by ``state``)."""
    combine: Combine | None = None
    """For a session's figure: how its trainer's sessions combine."""
    buckets: tuple[float, ...] = ()
    """A histogram's bucket bounds."""


def plain(meaning: str, *, key: str = "", part: type | None = None, default: Any = MISSING) -> Any:
    """A field of the body that is no metric: ``meaning`` for the reference, ``key`` where the
    body's key is not the field's name (a Python keyword), ``part`` the record type of a nested
    record or of each row of a list."""
    return field(default=default, metadata={_HELP: meaning, _KEY: key, _PART: part})


def figure(
    name: str, kind: Kind, meaning: str, *, by: str = "", combine: Combine | None = None,
    key: str = "", default: Any = MISSING,
) -> Any:  # fmt: skip
    """A field that is also a metric: ``name``, ``kind`` and ``meaning`` (its help)."""
    metric = Metric(name, kind, meaning, by, combine)
    return field(default=default, metadata={_HELP: meaning, _KEY: key, _METRIC: metric})


def key_of(f: Field[Any]) -> str:
    """The body's key for a field."""
    return str(f.metadata.get(_KEY) or f.name)


def meaning_of(f: Field[Any]) -> str:
    return str(f.metadata.get(_HELP, ""))


def metric_of(f: Field[Any]) -> Metric | None:
    metric = f.metadata.get(_METRIC)
    return metric if isinstance(metric, Metric) else None


def part_of(f: Field[Any]) -> type | None:
    part = f.metadata.get(_PART)
    return part if isinstance(part, type) else None


# --- the records ---------------------------------------------------------------------------------

R = TypeVar("R")


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(plain, figure))
def record(cls: type[R]) -> type[R]:
    """A frozen record of the body, its fields given by keyword, each declared with ``plain`` or
    ``figure`` (a field without ``default=`` must be given)."""
    return dataclass(frozen=True, kw_only=True)(cls)


@record
class Record:
    """A part of the body. ``LABELS``: (label, field) pairs it adds to its metrics' labels;
    ``IDENTITY``: the field naming one session, for records whose figures combine per trainer."""

    LABELS: ClassVar[tuple[tuple[str, str], ...]] = ()
    IDENTITY: ClassVar[str] = ""


@record
class LoadStatus(Record):
    """NOTE [ Fleet load ]: what an autoscaler reads, and the two figures it is made of."""

    load: float = figure(
        "dataferry_load",
        "gauge",
        "Decode capacity the trainers ask for, in multiples "
        "of this service's (busy x demand; NOTE [ Fleet load ]): the autoscaling signal.",
    )
    busy: float = figure(
        "dataferry_decode_busy_ratio", "gauge", "Share of the decode workers' time on tasks, last 10 s."
    )
    demand: float = figure("dataferry_demand", "gauge", "The trainers' (waited + computed) / computed, "
                           "last 10 s, as far as the service saw them wait, weighted by the batches each "
                           "took (NOTE [ Fleet load ]).")  # fmt: skip


@record
class ShmStatus(Record):
    """/dev/shm as ``df`` says, where the slot pools and sample caches live (NOTE [ A /dev/shm floor ])."""

    free_bytes: int = figure(
        "dataferry_shm_free_bytes",
        "gauge",
        "Bytes free on /dev/shm, where the slot pools and sample caches live.",
    )
    size_bytes: int = figure("dataferry_shm_size_bytes", "gauge", "Size of /dev/shm in bytes.")
    floor_bytes: int = plain("Bytes of /dev/shm a slot pool leaves free for others when it grows.")


@record
class SizingWindow(Record):
    """The last window the worker sizer measured (NOTE [ Sizing workers ])."""

    busy: float = plain("Share of the active workers' time on tasks.")
    cost: float = plain("CPU seconds the workers spent per second on tasks.")
    rate: float = plain("Images decoded a second.")
    demand: float = plain("The trainers' (waited + computed) / computed.")
    step_ms: float | None = plain("The trainers' mean step, in ms; null before any was measured.")


@record
class SizingDecision(Record):
    """One change of the active workers and why."""

    seconds_ago: float = plain("Seconds since it was made.")
    before: int = plain("Active workers before.", key="from")
    after: int = plain("Active workers after.", key="to")
    reason: str = plain("Why, in words.")


@record
class SizingStatus(Record):
    """Decode workers taking tasks, and why (NOTE [ Sizing workers ])."""

    mode: str = plain("``auto`` (``--workers auto``) or ``pinned`` (a number).")
    active: int = figure(
        "dataferry_decode_workers_active", "gauge", "Decode workers taking tasks (NOTE [ Sizing workers ])."
    )
    started: int = plain("Decode worker processes started, taking tasks or parked.")
    most: int = plain("The most workers there may be.")
    budget: float | None = figure(
        "dataferry_cpu_budget_cores",
        "gauge",
        "Cores the decode workers may use (NOTE [ CPU budget ]); --workers auto only.",
        default=None,
    )
    window: SizingWindow | None = plain(
        "The last window measured; auto only.", part=SizingWindow, default=None
    )
    decisions: tuple[SizingDecision, ...] = plain("The last decisions, oldest first; auto only.",
                                                  part=SizingDecision, default=())  # fmt: skip


@record
class WorkerStatus(Record):
    """One decode worker process."""

    LABELS = (("worker", "worker"),)

    worker: int = plain("The worker's number.")
    pid: int | None = plain("Its process id.")
    task: int | None = plain("The task it is on; null when it waits for one.")
    ready: bool = plain("Whether it has said it is ready.")
    decoded: int = plain("Images it decoded.")
    images_per_second: float = figure(
        "dataferry_worker_decode_images_per_second", "gauge", "Recent decode rate, per worker."
    )


@record
class CacheStatus(Record):
    """A feed's sample cache (NOTE [ Sample cache ])."""

    kind: str = plain("What it keeps: ``decoded`` images or ``encoded`` files.")
    bytes: int = figure("dataferry_cache_bytes", "gauge", "Sample cache size, per feed (--cache-memory).")
    bytes_used: int = figure("dataferry_cache_used_bytes", "gauge", "Sample cache bytes taken, per feed.")
    entries: int = figure("dataferry_cache_entries", "gauge", "Samples the cache keeps, per feed.")
    hits: int = figure("dataferry_cache_hits", "counter", "Samples made from the cache, per feed.")
    misses: int = figure(
        "dataferry_cache_misses", "counter", "Samples looked up and not in the cache, per feed."
    )
    full: bool = plain("Whether a sample found no room.")
    lock_timeouts: int = figure(
        "dataferry_cache_lock_timeouts", "counter", "Stores given up, the lock held too long, per feed."
    )


@record
class FeedSource(Record):
    """One source of a feed of several (NOTE [ Source ledger ])."""

    LABELS = (("source", "source"),)

    source: str = plain("The source's name.")
    samples: int = plain("Its samples.")
    served: int = figure(
        "dataferry_source_served_samples", "counter", "Rows announced to trainers, per feed and source."
    )


@record
class FeedStatus(Record):
    """One feed: its data, its slots, what its workers made of it."""

    LABELS = (("feed", "name"),)

    name: str = plain("The feed's name.")
    samples: int = plain("Samples in its data.")
    slots: dict[str, int] = figure(
        "dataferry_slots",
        "gauge",
        "Batch slots per feed and state (free, filling, ready, leased).",
        by="state",
    )
    slots_most: int = plain("The most slots its pool may grow to.")
    credits_most: int = plain("The most credits a trainer of it may hold.")
    pool_refused: int = plain("Times the pool did not grow: /dev/shm at its floor.")
    pool_given_back: int = plain("Slots given back to /dev/shm.")
    encoded_room_refused: int = plain(
        "Rows decoded by the service because their bytes did not fit "
        "a slot's room for encoded rows (NOTE [ Encoded rows ])."
    )
    decoded: int = figure("dataferry_decoded_images", "counter", "Images decoded, per feed.")
    images_per_second: float = figure(
        "dataferry_decode_images_per_second", "gauge", "Recent decode rate, per feed."
    )
    warm_decoded: int = plain("Images decoded ahead of a trainer's first batch.")
    split_batches: int = plain("Batches with rows left encoded.")
    encoded_rows: int = figure(
        "dataferry_encoded_rows",
        "counter",
        "Rows left encoded for their trainers to decode, per feed (NOTE [ Encoded rows ]).",
    )
    encoded_row_bytes: int = plain("Room a slot has for encoded rows, in bytes.")
    batches: int = figure("dataferry_batches", "counter", "Batches filled, per feed.")
    bad_files: int = figure("dataferry_bad_files", "counter", "Files skipped, per feed.")
    store_waits: int = figure(
        "dataferry_store_waits",
        "counter",
        "Tasks handed back because the data's store did not answer within the read deadline, per feed.",
    )
    recent_bad_files: tuple[str, ...] = plain("The last bad files' paths (200 characters each).")
    format: str = plain("The data's format (``--format``).")
    augment: str = plain("The transform (``--augment``), or ``pipeline``.")
    interpolation: str = plain("The resize filter; empty for a pipeline.")
    fields: tuple[str, ...] = plain("The fields each row carries.")
    cache: CacheStatus | None = plain("Its sample cache; null without one.", part=CacheStatus)
    sources: tuple[FeedSource, ...] = plain("Its sources, for a feed of several.", part=FeedSource)


@record
class SessionSource(Record):
    """One trainer's ledger of a source (NOTE [ Source ledger ])."""

    LABELS = (("source", "source"),)

    source: str = plain("The source's name.")
    served: int = figure(
        "dataferry_trainer_source_served_samples",
        "counter",
        "Rows announced to a trainer, by source (NOTE [ Trainer series ]).",
        combine="counted",
    )
    share: float = plain("Its share of the rows the trainer was served.")
    asked: float = figure(
        "dataferry_trainer_source_asked_ratio",
        "gauge",
        "The share of a source a trainer's weights ask for now.",
        combine="largest",
    )
    passes: int | None = figure(
        "dataferry_trainer_source_pass",
        "gauge",
        "A weighted job's pass over a source; null for a job without weights.",
        combine="largest",
        key="pass",
    )
    position: int | None = plain("Its position in that pass; null for a job without weights.")


@record
class SessionStatus(Record):
    """One trainer's session on one feed."""

    LABELS = (("client", "client"), ("feed", "feed"))
    IDENTITY = "session"

    session: str = plain("The session's id.")
    client: str = plain("The client name its hello gave (``host:pid`` for ``ServiceLoader``).")
    feed: str = plain("Its feed.")
    mode: str = plain("``shard`` or ``broadcast``.")
    rank: int = plain("Its shard's rank.")
    world_size: int = plain("Its shards.")
    group: str = plain("Its broadcast group; empty for a shard.")
    epoch: int = plain("Its epoch.")
    delivered: int = plain("Batches announced to it.")
    leased: int = figure(
        "dataferry_trainer_leased_batches", "gauge", "Batches a trainer holds.", combine="sum"
    )
    resent: int = plain("Batches announced to it again after a reconnect.")
    recovered_releases: int = plain("Its leases released by the service for it.")
    credits: int = figure(
        "dataferry_trainer_credits", "gauge", "Credits a trainer has granted.", combine="sum"
    )
    credits_asked: int = plain("Credits its hello asked for.")
    lag: int = figure(
        "dataferry_trainer_lag_batches",
        "gauge",
        "Batches decoded for a trainer that it has not taken yet.",
        combine="sum",
    )
    idle_seconds: float = plain("Seconds since it was last heard.")
    demand: float = figure(
        "dataferry_trainer_loop_demand",
        "gauge",
        "A trainer's (waited + computed) / "
        "computed over the last 10 s, as far as the service saw it wait (NOTE "
        "[ Exposed wait ], NOTE [ Fleet load ]).",
        combine="largest",
    )
    encode_share: float = figure(
        "dataferry_trainer_encode_ratio",
        "gauge",
        "The share of a trainer's rows it decodes itself (NOTE [ Encoded rows ]).",
        combine="largest",
    )
    spoiled: int = plain("Rows it could not decode and reported.")
    sources: tuple[SessionSource, ...] = plain("Its ledger by source, for a feed of several.",
                                               part=SessionSource)  # fmt: skip


@record
class ServiceStatus(Record):
    """The whole body (NOTE [ A status fits one frame ])."""

    uptime: float = figure("dataferry_uptime_seconds", "gauge", "Seconds since the service started.")
    attached: int = figure("dataferry_trainers_attached", "gauge", "Trainer sessions attached.")
    workers: int = figure("dataferry_decode_workers", "gauge", "Decode worker processes.")
    worker_restarts: int = figure(
        "dataferry_worker_restarts", "counter", "Decode workers replaced after dying."
    )
    template_restarts: int = plain("Times the template that forks workers was replaced.")
    rejected_messages: int = figure(
        "dataferry_rejected_messages", "counter", "Trainer messages rejected as invalid."
    )
    remote_send_bytes: int = plain("Bytes held for remote trainers' sends (NOTE [ Remote sends ]).")
    load: LoadStatus = plain("The fleet load and what it is made of.", part=LoadStatus)
    shm: ShmStatus | None = plain("/dev/shm's space; null where it cannot be read.", part=ShmStatus)
    sizing: SizingStatus = plain("The decode workers' sizing.", part=SizingStatus)
    worker_list: tuple[WorkerStatus, ...] = plain("Each decode worker, 64 at most.", part=WorkerStatus)
    feeds: tuple[FeedStatus, ...] = plain("The feeds that fit the frame, 16 at most.", part=FeedStatus)
    feeds_left_out: int = plain("Feeds not listed: the reply fits one frame.")
    sessions: tuple[SessionStatus, ...] = plain(
        "The sessions that fit the frame, in the order they attached, 100 at most.", part=SessionStatus
    )
    sessions_left_out: int = plain("Sessions not listed: the reply fits one frame.")


WAIT_BUCKETS = (  # seconds, 100 us to 10 s
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
READY_WAIT = Metric(
    "dataferry_batch_ready_wait_seconds",
    "histogram",
    "Time a decoded batch waited in a ready slot before a trainer leased it.",
    by="feed",
    buckets=WAIT_BUCKETS,
)
BATCH_WAIT = Metric(
    "dataferry_batch_wait_seconds",
    "histogram",
    "Time each training step waited for its next batch (the data stall).",
    by="endpoint",
    buckets=WAIT_BUCKETS,
)
"""The two histograms, observed as events happen rather than read from a body: the service's,
labelled ``feed``, and a trainer's (``gpu-worker run --metrics-port``), labelled ``endpoint``."""


# --- made into a body, and read back as metrics ----------------------------------------------------


def to_body(value: object) -> Any:
    """A record as the msgpack maps of its body, under each field's key (nested records too)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, Record):
        return {key: to_body(getattr(value, name)) for name, key in KEYS[type(value)]}
    if isinstance(value, (list, tuple)):
        return [to_body(item) for item in value]
    if isinstance(value, Mapping):
        return {str(k): to_body(v) for k, v in value.items()}
    return value


def records() -> tuple[type[Record], ...]:
    """Every record type of the body, the whole first, each before the parts it holds."""
    seen: list[type[Record]] = []

    def visit(cls: type[Record]) -> None:
        if cls not in seen:
            seen.append(cls)
            for f in fields(cls):
                if (part := part_of(f)) is not None:
                    visit(part)

    visit(ServiceStatus)
    return tuple(seen)


def metrics() -> Iterator[tuple[type[Record], Metric]]:
    """Every metric a body gives, with the record that declares it."""
    for cls in records():
        for f in fields(cls):
            if (metric := metric_of(f)) is not None:
                yield cls, metric


def labels_of(path: tuple[type[Record], ...], metric: Metric) -> tuple[str, ...]:
    """The labels of ``metric`` declared by the last record of ``path`` (the records above it)."""
    names = [label for cls in path for label, _ in cls.LABELS]
    return (*names, metric.by) if metric.by else tuple(names)


def paths() -> dict[type[Record], tuple[type[Record], ...]]:
    """Each record and the records from the whole body down to it."""
    found: dict[type[Record], tuple[type[Record], ...]] = {}

    def visit(cls: type[Record], above: tuple[type[Record], ...]) -> None:
        found.setdefault(cls, (*above, cls))
        for f in fields(cls):
            if (part := part_of(f)) is not None:
                visit(part, (*above, cls))

    visit(ServiceStatus, ())
    return found


KEYS: Mapping[type, tuple[tuple[str, str], ...]] = {
    cls: tuple((f.name, key_of(f)) for f in fields(cls)) for cls in records()
}
"""(field name, body key) of each field, by record type: ``to_body`` runs once a second over every
listed session."""


@dataclass(frozen=True)
class Sample:
    """One value a body gives a metric: its labels, and the session it came from (if any)."""

    metric: Metric
    labels: Labels
    value: float
    session: str


def samples(body: Mapping[str, Any]) -> Iterator[Sample]:
    """Every metric value a body (trusted no further than its types) gives, with its labels."""
    yield from _walk(ServiceStatus, body, (), "")


def _walk(cls: type[Record], body: Mapping[str, Any], above: Labels, session: str) -> Iterator[Sample]:
    labels = (*above, *((label, _text(body.get(key))) for label, key in cls.LABELS))
    if cls.IDENTITY:
        session = _text(body.get(cls.IDENTITY))
    for f in fields(cls):
        value = body.get(key_of(f))
        if (metric := metric_of(f)) is not None:
            pairs = value.items() if metric.by and isinstance(value, Mapping) else ()
            for label, number in pairs if metric.by else (("", value),):
                if (got := _number(number)) is not None:
                    at = (*labels, (metric.by, str(label))) if metric.by else labels
                    yield Sample(metric, tuple(at), got, session)
        elif (part := part_of(f)) is not None:
            for row in value if isinstance(value, list) else [value]:
                if isinstance(row, Mapping):
                    yield from _walk(part, row, tuple(labels), session)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _text(value: object) -> str:
    return "" if value is None else str(value)
