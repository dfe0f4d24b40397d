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

import torch

from gpu_worker.client import ServiceLoader

log = logging.getLogger(__name__)
StepFn = Callable[[torch.Tensor, torch.Tensor], Any]


@dataclass(frozen=True)
class RunConfig:
    endpoint: str
    step: str = "gpu_worker.demo_step:step"
    device: str = "auto"
    epochs: int = 1
    feed: str = ""
    timeout: float = 60.0


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    batches: int
    images: int
    seconds: float
    waited: float

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def stall(self) -> float:
        return self.waited / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"epoch {self.epoch}: {self.images} images in {self.batches} batches, {self.seconds:.1f} s, "
            f"{self.images_per_second:.1f} images/s, data stall {self.stall:.1%}"
        )


def load_step(spec: str) -> StepFn:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--step must look like MODULE:FUNCTION, got {spec!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec} is not a callable step(images, labels)")
    return fn  # type: ignore[no-any-return]


def run_epoch(
    loader: ServiceLoader, step: StepFn, epoch: int, progress: Callable[[int, int], None]
) -> EpochReport:
    loader.set_epoch(epoch)
    batches = images = 0
    waited = 0.0
    start = time.perf_counter()
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)
        waited += time.perf_counter() - t0
        if batch is None:
            break
        step(batch.images, batch.labels)
        batches += 1
        images += int(batch.images.shape[0])
        del batch  # returns the slot before we wait for the next one
        progress(batches, len(loader))
    return EpochReport(epoch, batches, images, time.perf_counter() - start, waited)


def run(cfg: RunConfig) -> list[EpochReport]:
    step = load_step(cfg.step)
    reports = []
    with ServiceLoader(cfg.endpoint, device=cfg.device, feed=cfg.feed, timeout=cfg.timeout) as loader:
        info = loader.info
        print(
            f"attached to feed {info.name!r}: {info.samples} images, "
            f"{len(loader)} batches of {info.batch_size} "
            f"per epoch, {info.image_size}px, device {loader.device}",
            file=sys.stderr,
            flush=True,
        )
        for epoch in range(cfg.epochs):
            report = run_epoch(loader, step, epoch, _progress(epoch))
            print(report.line(), flush=True)
            reports.append(report)
    return reports


def _progress(epoch: int) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"epoch {epoch}: batch {done}/{total}", file=sys.stderr, flush=True)

    return report
