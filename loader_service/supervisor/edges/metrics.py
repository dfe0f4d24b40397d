"""Optional Prometheus metrics for the service (``--metrics-port``) and for trainers.

``prometheus_client`` is imported only when metrics are asked for, so the service runs without it;
asking for them without it raises ``MetricsUnavailable`` naming the package.

The service's metrics are its status snapshot (``LoaderService.status``), handed to
``ServiceMetrics.update`` from the main loop and turned into samples when Prometheus scrapes. The
HTTP server thread never touches service state, and trainers or workers that are gone simply stop
appearing. A trainer's series are the trainer's, not its sessions': labelled by client and feed,
as many as the sessions a status lists at most (NOTE [ Trainer series ], in ``trainer_metrics``).
Counters are the service's own running totals: they restart from 0 with the service, which
Prometheus's ``rate()`` handles as a counter reset.

    dataferry_uptime_seconds                                   gauge
    dataferry_trainers_attached                                gauge
    dataferry_decode_workers                                   gauge
    dataferry_worker_restarts_total                            counter
    dataferry_rejected_messages_total                          counter
    dataferry_decoded_images_total{feed}                       counter
    dataferry_decode_images_per_second{feed}                   gauge
    dataferry_batches_total{feed}                              counter
    dataferry_slots{feed, state}                               gauge   (free, filling, ready, leased)
    dataferry_bad_files_total{feed}                            counter
    dataferry_encoded_rows_total{feed}                         counter (decoded by their trainers)
    dataferry_store_waits_total{feed}                          counter (tasks handed back: a silent store)
    dataferry_cache_bytes{feed}                                gauge   (the cache's size, --cache-memory)
    dataferry_cache_used_bytes{feed}                           gauge
    dataferry_cache_entries{feed}                              gauge
    dataferry_cache_hits_total{feed}                           counter
    dataferry_cache_misses_total{feed}                         counter
    dataferry_cache_lock_timeouts_total{feed}                  counter (stores given up: lock held)
    dataferry_worker_decode_images_per_second{worker}          gauge
    dataferry_trainer_lag_batches{client, feed}                gauge   (decoded, not yet taken)
    dataferry_trainer_credits{client, feed}                    gauge
    dataferry_trainer_leased_batches{client, feed}             gauge
    dataferry_batch_ready_wait_seconds{feed}                   histogram (``observe_ready_wait``)
    dataferry_decode_workers_active                            gauge   (NOTE [ Sizing workers ])
    dataferry_cpu_budget_cores                                 gauge   (--workers auto only)
    dataferry_load                                             gauge   (busy x demand, NOTE [ Fleet load ])
    dataferry_decode_busy_ratio                                gauge   (0 to 1)
    dataferry_demand                                           gauge
    dataferry_trainer_loop_demand{client, feed}                gauge
    dataferry_trainer_encode_ratio{client, feed}               gauge   (rows it decodes itself, 0 to 1)
    dataferry_source_served_samples_total{feed, source}        counter (a feed of several sources)
    dataferry_trainer_source_served_samples_total{client, feed, source}  counter
    dataferry_trainer_source_asked_ratio{client, feed, source}           gauge (0 to 1)
    dataferry_trainer_source_pass{client, feed, source}                  gauge (weighted jobs)
    dataferry_shm_free_bytes                                   gauge   (/dev/shm, as ``df`` says)
    dataferry_shm_size_bytes                                   gauge

Renamed, the old name still exported with the same value for one release (``RENAMED``), then
removed: ``dataferry_decode_busy`` is ``dataferry_decode_busy_ratio``, since a share of 0 to 1
carries Prometheus's unit suffix ``_ratio`` like seconds carry ``_seconds`` (the per-source asked
share, never released under another name, is ``_ratio`` from the start).
``dataferry_load`` and the demands keep theirs: multiples of a capacity, with no upper bound,
have no unit to name.

Trainers have their own: ``dataferry_batch_wait_seconds`` in ``gpu_worker/metrics.py``. Rules and
a dashboard built on these are in ``deploy/prometheus/`` and ``deploy/grafana/``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from loader_service.supervisor.edges.trainer_metrics import ServedKey, ServedRows, trainer_families

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

PACKAGE = "prometheus_client"
WAIT_BUCKETS = (  # seconds, 100 us to 10 s
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
SLOT_STATES = ("free", "filling", "ready", "leased")
RENAMED = {"dataferry_decode_busy_ratio": "dataferry_decode_busy"}
"""New name -> the old one, exported beside it until the next release (the module's docstring)."""


class MetricsUnavailable(RuntimeError):
    """Metrics were asked for but ``prometheus_client`` is not installed."""


def require_prometheus_client() -> None:
    """Raise ``MetricsUnavailable`` with how to install the package unless it can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise MetricsUnavailable(
            f"metrics need the Python package {PACKAGE!r}, which is not installed: "
            f"pip install {PACKAGE} (into the environment that runs dataferry)"
        ) from None


class _MetricsServer:
    """The HTTP endpoint Prometheus scrapes, serving one registry from a daemon thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: WSGIServer | None = None

    def start(self, port: int, addr: str) -> None:
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError("the metrics server is already running")
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self._registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from None

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ServiceMetrics:
    """The service's gauges and counters, fed from its status snapshot; a private registry each."""

    def __init__(self) -> None:
        require_prometheus_client()
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self._served = ServedRows()
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)
        self._ready_wait = Histogram(
            "dataferry_batch_ready_wait_seconds",
            "Time a decoded batch waited in a ready slot before a trainer leased it.",
            ["feed"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self._server = _MetricsServer(self.registry)

    def start(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (port 0: any free port)."""
        self._server.start(port, addr)

    @property
    def port(self) -> int | None:
        """The port being served, None before ``start``."""
        return self._server.port

    def stop(self) -> None:
        self._server.stop()

    def update(self, body: Mapping[str, Any]) -> None:
        """Take a new status snapshot (call from the main loop, about once a second)."""
        self._snapshot.last = (body, self._served.update(_records(body, "sessions")))

    def observe_ready_wait(self, feed: str, seconds: float) -> None:
        """A batch of ``feed`` went from ready to leased after waiting ``seconds``."""
        self._ready_wait.labels(feed=feed).observe(seconds)


# --- the status snapshot as metric families ------------------------------------------------------


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _records(body: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = body.get(key)
    return [r for r in items if isinstance(r, Mapping)] if isinstance(items, list) else []


class _SnapshotCollector:
    """Builds every sample from the last snapshot at scrape time (nothing before the first one)."""

    def __init__(self) -> None:
        self.last: tuple[Mapping[str, Any], Mapping[ServedKey, float]] | None = None
        """The last snapshot, and the rows served to its trainers (NOTE [ Trainer series ])."""

    def collect(self) -> Iterator[Metric]:
        if self.last is None:
            return
        body, served = self.last
        yield from _service_families(body)
        yield from _feed_families(_records(body, "feeds"))
        yield from _worker_families(_records(body, "worker_list"))
        yield from trainer_families(_records(body, "sessions"), served)


def _service_families(body: Mapping[str, Any]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily

    gauges = (
        ("dataferry_uptime_seconds", "Seconds since the service started.", "uptime"),
        ("dataferry_trainers_attached", "Trainer sessions attached.", "attached"),
        ("dataferry_decode_workers", "Decode worker processes.", "workers"),
    )
    yield from _gauges(body, gauges)
    counters = (
        ("dataferry_worker_restarts", "Decode workers replaced after dying.", "worker_restarts"),
        ("dataferry_rejected_messages", "Trainer messages rejected as invalid.", "rejected_messages"),
    )
    for name, doc, key in counters:
        if (value := _num(body.get(key))) is not None:
            yield CounterMetricFamily(name, doc, value=value)
    yield from _gauges(body.get("sizing"), SIZING_GAUGES)
    yield from _with_old_names(_gauges(body.get("load"), LOAD_GAUGES))
    yield from _gauges(body.get("shm"), SHM_GAUGES)


SIZING_GAUGES = (
    ("dataferry_decode_workers_active", "Decode workers taking tasks (NOTE [ Sizing workers ]).", "active"),
    ("dataferry_cpu_budget_cores", "Cores the decode workers may use (NOTE [ CPU budget ]).", "budget"),
)
LOAD_GAUGES = (
    ("dataferry_load", "Decode capacity the trainers ask for, in multiples of this service's "
     "(busy x demand; NOTE [ Fleet load ]): the autoscaling signal.", "load"),
    ("dataferry_decode_busy_ratio", "Share of the decode workers' time on tasks, last 10 s.", "busy"),
    ("dataferry_demand", "The trainers' (waited + computed) / computed, last 10 s, as far as the service "
     "saw them wait, weighted by the batches each took (NOTE [ Fleet load ]).", "demand"),
)  # fmt: skip


SHM_GAUGES = (
    ("dataferry_shm_free_bytes", "Bytes free on /dev/shm, where the slot pools and sample caches live.",
     "free_bytes"),
    ("dataferry_shm_size_bytes", "Size of /dev/shm in bytes.", "size_bytes"),
)  # fmt: skip


def _with_old_names(families: Iterator[Metric]) -> Iterator[Metric]:
    """Each family, then a copy under its old name for one that ``RENAMED`` (the module's docstring)."""
    from prometheus_client.metrics_core import Metric

    for family in families:
        yield family
        if (old := RENAMED.get(family.name)) is not None:
            copy = Metric(old, f"Deprecated, the same as {family.name}: {family.documentation}", family.type)
            copy.samples = [sample._replace(name=old) for sample in family.samples]
            yield copy


def _gauges(table: object, specs: tuple[tuple[str, str, str], ...]) -> Iterator[Metric]:
    """One gauge per (name, help, key) of ``specs`` that ``table`` (a status body's mapping) gives."""
    from prometheus_client.core import GaugeMetricFamily

    for name, doc, key in specs:
        if isinstance(table, Mapping) and (value := _num(table.get(key))) is not None:
            yield GaugeMetricFamily(name, doc, value=value)


def _feed_families(feeds: list[Mapping[str, Any]]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    decoded = CounterMetricFamily("dataferry_decoded_images", "Images decoded, per feed.", labels=["feed"])
    rate = GaugeMetricFamily(
        "dataferry_decode_images_per_second", "Recent decode rate, per feed.", labels=["feed"]
    )
    batches = CounterMetricFamily("dataferry_batches", "Batches filled, per feed.", labels=["feed"])
    bad = CounterMetricFamily("dataferry_bad_files", "Files skipped, per feed.", labels=["feed"])
    encoded = CounterMetricFamily(
        "dataferry_encoded_rows",
        "Rows left encoded for their trainers to decode, per feed (NOTE [ Encoded rows ]).",
        labels=["feed"],
    )
    waits = CounterMetricFamily(
        "dataferry_store_waits",
        "Tasks handed back because the data's store did not answer within the read deadline, per feed.",
        labels=["feed"],
    )
    slots = GaugeMetricFamily("dataferry_slots", "Batch slots per feed and state.", labels=["feed", "state"])
    for feed in feeds:
        name = str(feed.get("name", ""))
        for family, key in ((decoded, "decoded"), (rate, "images_per_second"), (batches, "batches")):
            _add(family, [name], feed.get(key))
        _add(bad, [name], feed.get("bad_files"))
        _add(encoded, [name], feed.get("encoded_rows"))
        _add(waits, [name], feed.get("store_waits"))
        counts = feed.get("slots")
        for state in SLOT_STATES:
            _add(slots, [name, state], counts.get(state) if isinstance(counts, Mapping) else None)
    yield from (decoded, rate, batches, bad, encoded, waits, slots)
    yield from _cache_families(feeds)
    yield from _source_families(feeds)


def _source_families(feeds: list[Mapping[str, Any]]) -> Iterator[Metric]:
    """Rows served by source, for feeds of several (NOTE [ Source ledger ])."""
    from prometheus_client.core import CounterMetricFamily

    served = CounterMetricFamily(
        "dataferry_source_served_samples",
        "Rows announced to trainers, per feed and source.",
        labels=["feed", "source"],
    )
    for feed in feeds:
        sources = feed.get("sources")
        if isinstance(sources, list) and len(sources) > 1:
            for row in sources:
                if isinstance(row, Mapping):
                    _add(served, [str(feed.get("name", "")), str(row.get("source", ""))], row.get("served"))
    yield served


def _cache_families(feeds: list[Mapping[str, Any]]) -> Iterator[Metric]:
    """The sample cache of each feed that has one (NOTE [ Sample cache ])."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "bytes": GaugeMetricFamily("dataferry_cache_bytes", "Sample cache size, per feed.", labels=["feed"]),
        "bytes_used": GaugeMetricFamily(
            "dataferry_cache_used_bytes", "Sample cache bytes taken, per feed.", labels=["feed"]
        ),
        "entries": GaugeMetricFamily(
            "dataferry_cache_entries", "Samples the cache keeps, per feed.", labels=["feed"]
        ),
        "hits": CounterMetricFamily(
            "dataferry_cache_hits", "Samples made from the cache, per feed.", labels=["feed"]
        ),
        "misses": CounterMetricFamily(
            "dataferry_cache_misses", "Samples looked up and not in the cache, per feed.", labels=["feed"]
        ),
        "lock_timeouts": CounterMetricFamily(
            "dataferry_cache_lock_timeouts", "Stores given up, the lock held too long.", labels=["feed"]
        ),
    }
    for feed in feeds:
        cache = feed.get("cache")
        if isinstance(cache, Mapping):
            for key, family in families.items():
                _add(family, [str(feed.get("name", ""))], cache.get(key))
    yield from families.values()


def _worker_families(workers: list[Mapping[str, Any]]) -> Iterator[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    rate = GaugeMetricFamily(
        "dataferry_worker_decode_images_per_second", "Recent decode rate, per worker.", labels=["worker"]
    )
    for worker in workers:
        _add(rate, [str(worker.get("worker", ""))], worker.get("images_per_second"))
    yield rate


def _add(family: CounterMetricFamily | GaugeMetricFamily, labels: list[str], value: object) -> None:
    if (number := _num(value)) is not None:
        family.add_metric(labels, number)
