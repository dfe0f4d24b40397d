"""The trainer's Prometheus metric: how long each step waited for its batch (the data stall), by the
endpoint of the service that delivered it (a fleet has several).

``prometheus_client`` is imported only when metrics are asked for (``gpu-worker run
--metrics-port``). Kept apart from the service's metrics module: a trainer never imports
``loader_service``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.status import BATCH_WAIT

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


class MetricsUnavailable(RuntimeError):
    """Metrics were asked for but ``prometheus_client`` is not installed."""


class TrainerMetrics:
    """``dataferry_batch_wait_seconds{endpoint}``: a histogram of the time each step waited for its
    batch, labelled with the service that delivered it."""

    def __init__(self) -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram
        except ImportError:
            raise MetricsUnavailable(
                "metrics need the Python package 'prometheus_client': pip install prometheus_client"
            ) from None
        self.registry = CollectorRegistry()
        self._batch_wait = Histogram(
            BATCH_WAIT.name,
            BATCH_WAIT.help,
            [BATCH_WAIT.by],
            buckets=BATCH_WAIT.buckets,
            registry=self.registry,
        )
        self._server: WSGIServer | None = None

    def start(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` (several ranks on one host need one port each)."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe(self, seconds: float, endpoint: str) -> None:
        self._batch_wait.labels(endpoint=endpoint).observe(seconds)
