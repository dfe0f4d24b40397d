"""``gpu-worker run``: drive a training step over the feed and report throughput and data stall.

Data stall is the fraction of wall time the loop spent waiting for its next batch; on an accelerator
the step's time is the CPU side of the step (kernel launches, plus whatever it synchronises on).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_worker.client import ServiceLoader
from gpu_worker.epoch_report import EpochReport
from gpu_worker.metrics import TrainerMetrics
from protocol.layout import describe_fields

log = logging.getLogger(__name__)
StepFn = Callable[..., Any]
"""Called with a batch's fields in the feed's order: ``step(images, labels)`` for the built-in ones."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """``gpu-worker run``'s one config, by keyword: eleven fields of which several are strings."""

    endpoints: tuple[str, ...]
    """One service or a fleet; () takes DATAFERRY_ENDPOINTS."""
    step: str = "gpu_worker.demo_step:step"
    device: str = "auto"
    epochs: int = 1
    feed: str = ""
    timeout: float = 60.0
    metrics_port: int = 0
    transport: str = "auto"
    server_key: str = ""
    client_key: str = ""
    resolve_interval: float = 5.0
    """Seconds between lookups of an endpoint naming a host (NOTE [ A fleet from a name ])."""


def report_line(report: EpochReport) -> str:
    """What ``gpu-worker run`` prints for an epoch: the loader's own line's figures, with the wait
    as the data stall (the share of the wall time spent waiting for the next batch)."""
    stall = report.waited / report.seconds if report.seconds > 0 else 0.0
    return (
        f"epoch {report.epoch}: {report.images} images in {report.batches} batches, {report.seconds:.1f} s, "
        f"{report.images_per_s:.1f} images/s, data stall {stall:.1%} ({report.verdict})"
    )


def load_step(spec: str) -> StepFn:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--step must look like MODULE:FUNCTION, got {spec!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec} is not a callable step(*fields), e.g. step(images, labels)")
    return fn  # type: ignore[no-any-return]


class Progress:
    """A tqdm bar per epoch (images/s, stall) on a terminal; a line every tenth of an epoch otherwise."""

    def __init__(self, epoch: int, total: int) -> None:
        self.epoch, self.total = epoch, total
        self._bar: Any = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=False)

    def update(self, batches: int, images: int, waited: float, elapsed: float) -> None:
        if self._bar is not None:
            rate = images / elapsed if elapsed > 0 else 0.0
            self._bar.set_postfix_str(
                f"{rate:.0f} img/s, stall {waited / max(elapsed, 1e-9):.0%}", refresh=False
            )
            self._bar.update(1)
        elif batches == self.total or batches % max(1, self.total // 10) == 0:
            print(f"epoch {self.epoch}: batch {batches}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_epoch(
    loader: ServiceLoader, step: StepFn, epoch: int, on_wait: Callable[[float, str], None]
) -> EpochReport:
    loader.set_epoch(epoch)
    batches = images = 0
    waited = 0.0
    progress = Progress(epoch, len(loader))
    start = time.perf_counter()
    it = iter(loader)
    try:
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            wait = time.perf_counter() - t0
            if batch is None:
                break
            waited += wait
            on_wait(wait, loader.last_endpoint)
            step(*batch)
            batches += 1
            images += int(batch.indices.shape[0])
            del batch  # returns the slot before we wait for the next one
            progress.update(batches, images, waited, time.perf_counter() - start)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    return EpochReport(epoch, batches, images, seconds, waited, max(0.0, seconds - waited))


def run(cfg: RunConfig) -> list[EpochReport]:
    step = load_step(cfg.step)
    reports = []
    with ServiceLoader(
        cfg.endpoints or None,
        device=cfg.device,
        feed=cfg.feed,
        timeout=cfg.timeout,
        transport=cfg.transport,
        server_key=cfg.server_key or None,
        client_key=cfg.client_key or None,
        resolve_interval=cfg.resolve_interval,
    ) as loader:
        info = loader.info
        services = len(loader.stats()["endpoints"])
        print(
            f"attached to feed {info.name!r}{f' on {services} services' if services > 1 else ''}: "
            f"{info.samples} images, "
            f"{len(loader)} batches of {info.batch_size} "
            f"per epoch, fields {describe_fields(loader.layout.fields)}, device {loader.device}",
            file=sys.stderr,
            flush=True,
        )
        metrics = _start_metrics(cfg.metrics_port)
        try:
            for epoch in range(cfg.epochs):
                report = run_epoch(loader, step, epoch, metrics.observe if metrics else _ignore)
                print(report_line(report), flush=True)
                _print_shares(loader)
                reports.append(report)
        finally:
            if metrics is not None:
                metrics.stop()
    return reports


def _ignore(_: float, __: str) -> None:
    pass


def _print_shares(loader: ServiceLoader) -> None:
    """A fleet: what each service delivered so far, and how many batches moved after a loss."""
    stats = loader.stats()
    shares = stats["endpoints"]
    if len(shares) < 2:
        return
    total = sum(share["batches"] for share in shares.values()) or 1
    for endpoint, share in shares.items():
        print(
            f"  {endpoint}: {share['batches']} batches so far ({share['batches'] / total:.0%}), "
            f"{share['images_per_s']:.1f} images/s, {share['state']}",
            flush=True,
        )
    if stats["reassigned"]:
        print(f"  {stats['reassigned']} batches reassigned after a service was lost", flush=True)


def _start_metrics(port: int) -> TrainerMetrics | None:
    if not port:
        return None
    metrics = TrainerMetrics()
    metrics.start(port)
    print(f"metrics on http://127.0.0.1:{metrics.port}/metrics", file=sys.stderr, flush=True)
    return metrics
