"""Optional Prometheus metrics for the service (``--metrics-port``) and for trainers.

``prometheus_client`` is imported only when metrics are asked for, so the service runs without it;
asking for them without it raises ``MetricsUnavailable`` naming the package.

The service's metrics are its status body (``LoaderService.status``), handed to
``ServiceMetrics.update`` from the main loop and turned into samples when Prometheus scrapes. Which
fields are metrics, under what names, kinds, help and labels, is declared once with the body
(NOTE [ Status contract ], ``protocol/status.py``); the list is docs/reference/metrics.md,
generated from it. The HTTP server thread never touches service state, and trainers or workers
that are gone simply stop appearing. A trainer's series are the trainer's, not its sessions'
(NOTE [ Trainer series ], in ``trainer_metrics``). Counters are the service's own running totals:
they restart from 0 with the service, which Prometheus's ``rate()`` handles as a counter reset.

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

from loader_service.supervisor.edges.trainer_metrics import Counted, series
from protocol.status import READY_WAIT, labels_of, metrics, paths, samples

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

PACKAGE = "prometheus_client"
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
        self._counted = Counted()
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)
        self._ready_wait = Histogram(
            READY_WAIT.name,
            READY_WAIT.help,
            [READY_WAIT.by],
            buckets=READY_WAIT.buckets,
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
        given = list(samples(body))
        self._snapshot.last = series(given, self._counted.update(given))

    def observe_ready_wait(self, feed: str, seconds: float) -> None:
        """A batch of ``feed`` went from ready to leased after waiting ``seconds``."""
        self._ready_wait.labels(feed=feed).observe(seconds)


# --- the status body as metric families ------------------------------------------------------------


class _SnapshotCollector:
    """Builds every family from the last body's series at scrape time (nothing before the first)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[tuple[str, ...], float]] | None = None
        """Metric name -> label values -> value, each trainer's sessions combined (``series``)."""

    def collect(self) -> Iterator[Metric]:
        if self.last is None:
            return
        yield from _with_old_names(families(self.last))


def families(last: Mapping[str, Mapping[tuple[str, ...], float]]) -> Iterator[Metric]:
    """One family per metric the body declares (NOTE [ Status contract ]), with the values given."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    path = paths()
    for cls, metric in metrics():
        labels = list(labels_of(path[cls], metric))
        family: CounterMetricFamily | GaugeMetricFamily
        if metric.kind == "counter":
            family = CounterMetricFamily(metric.name, metric.help, labels=labels)
        else:
            family = GaugeMetricFamily(metric.name, metric.help, labels=labels)
        for values, value in last.get(metric.name, {}).items():
            family.add_metric(list(values), value)
        yield family


def _with_old_names(families: Iterator[Metric]) -> Iterator[Metric]:
    """Each family, then a copy under its old name for one that ``RENAMED`` (the module's docstring)."""
    from prometheus_client.metrics_core import Metric

    for family in families:
        yield family
        if (old := RENAMED.get(family.name)) is not None:
            copy = Metric(old, f"Deprecated, the same as {family.name}: {family.documentation}", family.type)
            copy.samples = [sample._replace(name=old) for sample in family.samples]
            yield copy
