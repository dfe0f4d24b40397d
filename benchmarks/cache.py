"""Scenario (o): the decoded-sample cache (``serve --cache-memory``, NOTE [ Sample cache ]).

    python -m benchmarks.cache [--out DIR] [--quick] [--parts train,eval,pipeline,first,half,memory]
    PYTHONPATH=$PWD $TV/bin/python -m benchmarks.cache      # with torchvision: the pipeline part too

On the benchmark photos (``datasets.prepare_data``: 2560 images, ``--quick`` 1024), batch 64, 224 px,
2 decode workers against DataLoaders of 2 workers, every contender at filter bilinear-antialias and
the same transform. A cache that "holds all" is the dataset's decoded size (every image's
H x W x 3, decoded once at the start, in entries of ``cache.entry_bytes``) plus the cache's own
``overhead_bytes`` and a margin; each such run checks that the service's status says ``full: false``
and keeps every sample. The parts:

* ``train``: the service's train feed (RandomResizedCrop + flip) with a cache holding all, against
  DataLoader+OpenCV at the same transform (``dl_opencv``). Epoch 1 fills the cache; then K - 1
  (K = 4, quick 3) interleaved rounds, each timing one epoch's worth of batches of each contender as
  ``scenarios.interleaved_rounds`` does (after the backlog and a warm-up), all from epochs 2 on.
  Target >= 2.5x (median of the per-round ratios).
* ``eval``: the same with ``--augment eval`` (the cache keeps finished samples) against the
  DataLoader running the same eval transform (run.py's (k) ``dl_opencv``). Target >= 10x.
* ``pipeline``: ``--pipeline examples/pipelines/torchvision_v2.py:train`` with a cache (it keeps
  decoded images) against a DataLoader over the same function (``make_pipeline_dataloader``), timed
  as ``train``; after the fill, one batch is checked sample for sample against the DataLoader's
  Dataset (so the cached images are the ones a decode gives). Target >= 1.3x. Skipped, with the
  reason, where ``import torchvision.transforms.v2`` fails (``pipelines.torchvision_problem``).
* ``first``: the first epoch, the cache filling, against the same service without a cache (its
  default ``--decoder auto``), train and eval, in rounds of fresh services started together (the
  order rotating; each timed from a settled service, its warm start done, to the epoch's last
  batch). Target >= 0.95x. Also train against ``--decoder opencv`` without a cache: a train feed
  with a cache decodes whole images (its pixels are opencv's), so that is the equal-pixels figure.
* ``half``: a cache of half the dataset's decoded size, train, against no cache (``--decoder auto``,
  and ``opencv``), epochs 1 to 4 (quick 3) timed alternately on services running side by side: per
  epoch the hit ratio (status hits and misses, deltas between settled points: each window also
  holds the next epoch's first batches decoded ahead) and the speed-up. Reported, no target.
* ``memory``: after each of those epochs, each service's process-tree anonymous memory plus its
  /dev/shm segments (``proctree``), with a cache holding all and with none (and the half cache's,
  when ``half`` runs too): at its highest, with the cache it must stay within the cache's size plus
  the highest figure without, give or take (g)'s allowance (max(4 MiB, 2%)). Also shown against a
  service without a cache decoding whole images (``--decoder opencv``), as one with a cache does.

``half`` and ``memory`` run on one set of services when both are asked for. Every line printed is
one measurement: name, value, target, PASS/FAIL ("-" where there is no target); all of it goes to
``cache.json`` in ``--out`` (default ``bench-results/``). Services are stopped, and must exit 0
leaving no /dev/shm segment, as in the main benchmark (NOTE [ Benchmark service lifecycle ]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from benchmarks.cli import run_benchmark
from benchmarks.config import BenchConfig, make_config
from benchmarks.contenders import Contender, loader_stream
from benchmarks.datasets import (
    DataSpec,
    OpenCVCrops,
    PipelineSamples,
    make_pipeline_dataloader,
    prepare_data,
)
from benchmarks.machine import machine_facts
from benchmarks.pipelines import H_PIPELINE, measure_identical, pipeline_spec, torchvision_problem
from benchmarks.proctree import cpu_seconds, memory, service_segments, shm_mib, tree
from benchmarks.progress import LazyProgress, progress, say
from benchmarks.results import DL_OPENCV, DL_PIPELINE, G_ABSOLUTE_MIB, G_RELATIVE, SERVICE
from benchmarks.run import DATALOADER_PREFETCH, BenchRun
from benchmarks.scenarios import interleaved_rounds, rotated, until_settled, wait_idle
from benchmarks.service_process import BenchError, ServiceProcess
from benchmarks.stats import median, paired_ratio, rate
from gpu_worker import ServiceLoader
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.cache import entry_bytes, overhead_bytes
from loader_service.decode.transforms import decode_file
from loader_service.tools.status_view import query_status
from protocol.layout import image_fields

PARTS = ("train", "eval", "pipeline", "first", "half", "memory")
INTERPOLATION = "bilinear-antialias"
MIB = 2**20
MARGIN_BYTES = 16 * MIB
"""Added to a cache that must hold every sample: room to spare beyond its entries and overhead."""
TRAIN_TARGET = 2.5
EVAL_TARGET = 10.0
PIPELINE_TARGET = 1.3
FIRST_TARGET = 0.95
NO_CACHE = "none"
NO_CACHE_OPENCV = "none-opencv"
"""No cache, ``--decoder opencv``: whole images decoded, as a train feed with a cache decodes them."""
HALF = "half"
FULL = "full"


@dataclass(frozen=True)
class Plan:
    images: int
    epochs: int
    """K: the steady-state parts time K - 1 epochs' worth of batches, from epoch 2 on."""
    first_rounds: int
    """``first``: rounds of fresh services, each timing every variant's first epoch once."""
    half_epochs: int
    """``half`` and ``memory``: epochs timed per service, from its first."""


FULL_PLAN = Plan(images=2560, epochs=4, first_rounds=3, half_epochs=4)
QUICK_PLAN = Plan(images=1024, epochs=3, first_rounds=1, half_epochs=3)


@dataclass(frozen=True)
class Verdict:
    """One printed line: what was measured, its value, the target and whether it was met (None: none)."""

    name: str
    value: str
    target: str = "-"
    passed: bool | None = None

    def line(self) -> str:
        verdict = "-" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return f"(o) {self.name} | {self.value} | target {self.target} | {verdict}"


@dataclass(frozen=True)
class CacheSizes:
    """Bytes of ``--cache-memory`` for each cache the parts start (``cache_bytes``)."""

    decoded_data: int
    """The dataset's decoded images (H x W x 3 each), what a decoded-kind cache must keep."""
    decoded_full: int
    decoded_half: int
    final_full: int
    """An eval cache holding every finished sample (image and label)."""


# --- pure arithmetic ---------------------------------------------------------------------------------


def cache_bytes(data_sizes: Sequence[int], workers: int, share: float = 1.0, margin: int = 0) -> int:
    """``--cache-memory`` for a cache keeping ``share`` of the entries of ``data_sizes`` (one sample's
    data bytes each): the cache's header and table, the entries' bytes, and ``margin``."""
    entries = sum(entry_bytes(size) for size in data_sizes)
    return overhead_bytes(len(data_sizes), workers) + math.floor(entries * share) + margin


def hit_ratio(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """Hits over lookups between two status readings of a cache (None if nothing was looked up)."""
    hits = int(after["hits"]) - int(before["hits"])
    lookups = hits + int(after["misses"]) - int(before["misses"])
    return hits / lookups if lookups > 0 else None


def memory_excess(with_cache: Sequence[float], without: Sequence[float], cache_mib: float) -> float:
    """MiB by which a service with a cache of ``cache_mib`` went past the same service without one plus
    the cache, each at its highest over the epochs sampled (at most 0 when it stayed within)."""
    return max(with_cache) - (max(without) + cache_mib)


def memory_allowance(without: Sequence[float]) -> float:
    """(g)'s allowance for allocator and page-cache noise, on the figure without a cache."""
    return max(G_ABSOLUTE_MIB, G_RELATIVE * max(without))


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def ratio_verdict(name: str, ratio: float | None, detail: str, target: float | None) -> Verdict:
    shown = "n/a" if ratio is None else f"{ratio:.2f}x"
    if target is None:
        return Verdict(name, f"{shown} ({detail})")
    passed = ratio is not None and ratio >= target
    return Verdict(name, f"{shown} ({detail})", f">= {target:g}x", passed)


# --- measuring -----------------------------------------------------------------------------------------


def decoded_sizes(index: DatasetIndex) -> list[int]:
    """Bytes of each image decoded as the service decodes it (``decode_file``: H x W x 3)."""
    sizes = []
    bar = progress("(o) decoded size of every image", len(index))
    for i in range(len(index)):
        sizes.append(decode_file(str(index.path(i))).nbytes)
        bar.update()
    bar.close()
    return sizes


def cache_status(endpoint: str, timeout: float) -> dict[str, Any]:
    """The service's first feed's cache counters (``status``: kind, bytes, entries, hits, misses, full)."""
    feeds = query_status(endpoint, timeout).get("feeds") or []
    found = feeds[0].get("cache") if feeds else None
    if not isinstance(found, dict):
        raise BenchError(f"the service at {endpoint} reports no cache for its feed")
    return found


def time_epoch(contender: Contender, batches_per_epoch: int) -> tuple[float, int]:
    """Seconds and images from asking for an epoch's first batch to holding its last, the tree idle
    first; the contender must stand at an epoch boundary."""
    if contender.last is not None and contender.last.position != batches_per_epoch - 1:
        raise BenchError(f"{contender.key}: not at an epoch boundary ({contender.last})")
    wait_idle()
    start = time.perf_counter()
    tick = contender.pull()
    images = tick.images
    if tick.position != 0:
        raise BenchError(f"{contender.key}: an epoch began at batch {tick.position}")
    while tick.position != batches_per_epoch - 1:
        tick = contender.pull()
        images += tick.images
    return time.perf_counter() - start, images


def first_epoch(endpoint: str, timeout: float) -> tuple[float, int]:
    """Seconds and images from constructing a trainer to holding the last batch of its epoch 0."""
    images = 0
    start = time.perf_counter()
    with ServiceLoader(endpoint, device="cpu", timeout=timeout, connect_timeout=timeout) as loader:
        for batch in loader:
            if batch.epoch != 0:
                raise BenchError(f"asked for epoch 0, got a batch of epoch {batch.epoch}")
            images += len(batch.indices)
            del batch  # before the next one and before close: a batch must not outlive its loader
        seconds = time.perf_counter() - start
    return seconds, images


@dataclass
class Cache:
    """The run: its settings, the services it started, and what it found."""

    bench: BenchRun
    plan: Plan
    sizes: CacheSizes
    verdicts: list[Verdict] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    _names: int = 0

    @property
    def cfg(self) -> BenchConfig:
        return self.bench.cfg

    @property
    def bpe(self) -> int:
        return self.bench.batches_per_epoch(self.cfg.batch_size)

    def add(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        print(verdict.line(), flush=True)

    def start(self, stack: contextlib.ExitStack, label: str, args: tuple[str, ...]) -> ServiceProcess:
        """A service of the run's settings plus ``args`` (later flags win over BenchRun's)."""
        self._names += 1
        return self.bench.start_service(stack, f"{label}-{self._names}", self.cfg.batch_size, extra_args=args)

    def check_holds_all(self, name: str, status: Mapping[str, Any]) -> bool:
        """A line saying whether a cache meant to hold every sample does: every one kept, not full."""
        held = int(status["entries"]) == self.bench.data.images and not status["full"]
        value = (
            f"{status['entries']}/{self.bench.data.images} samples kept, full {status['full']}, "
            f"{status['bytes_used'] / MIB:.0f} of {status['bytes'] / MIB:.0f} MiB used"
        )
        self.add(Verdict(f"{name}: the cache holds every sample", value, "all, not full", held))
        return held

    # --- train, eval, pipeline: steady state after the fill -------------------------------------------

    def steady(
        self,
        part: str,
        args: tuple[str, ...],
        dataloader: Callable[[contextlib.ExitStack], Contender],
        target: float,
        check: Callable[[ServiceProcess], dict[str, Any]] | None = None,
    ) -> None:
        """Epoch 1 fills the cache; then K - 1 interleaved rounds of one epoch's worth of batches each
        (``interleaved_rounds``), the service against the DataLoader ``dataloader`` starts."""
        cfg, bpe = self.cfg, self.bpe
        rounds = self.plan.epochs - 1
        with contextlib.ExitStack() as stack:
            loader = dataloader(stack)  # its workers fork before this process has ZeroMQ threads
            service = self.start(stack, part, args)
            served = self.bench.service_contender(stack, service)
            say(f"(o) {part}: epoch 1 fills the cache")
            fill_start = time.perf_counter()
            served.finish_epoch(bpe)
            fill_seconds = time.perf_counter() - fill_start
            endpoint = service.spec.endpoint
            until_settled(endpoint, cfg.timeout, warm=False)
            filled = cache_status(endpoint, cfg.timeout)
            checked = check(service) if check is not None else {}
            got = interleaved_rounds([served, loader], rounds, bpe, f"(o) {part}: rounds after the fill")
            after = cache_status(endpoint, cfg.timeout)
            last_epoch = served.last.epoch + 1 if served.last else 0
        service_rates, other_rates = got.rates[SERVICE], got.rates[loader.key]
        ratio = paired_ratio(service_rates, other_rates)
        hits = hit_ratio(filled, after)
        self.results[part] = {
            "rates": got.rates,
            "cpu_per_1000": got.cpu_per_1000,
            "ratio": ratio,
            "epochs_timed": [2, last_epoch],
            "fill_epoch_images_per_second": rate(self.bench.data.images, fill_seconds),
            "cache_after_fill": filled,
            "cache_after": after,
            "hit_ratio_timed": hits,
            **checked,
        }
        self.check_holds_all(part, filled)
        other = "DataLoader running the same function" if part == "pipeline" else "DataLoader+OpenCV"
        detail = (
            f"cache {median(service_rates) or 0:.0f} images/s, {other} {median(other_rates) or 0:.0f}; "
            f"{rounds} rounds of {bpe} batches, epochs 2-{last_epoch}; hits {percent(hits)}"
        )
        self.add(
            ratio_verdict(f"{part}, epochs 2-{last_epoch}, against the DataLoader", ratio, detail, target)
        )

    def train(self) -> None:
        say(f"(o) train: a cache of {self.sizes.decoded_full / MIB:.0f} MiB against DataLoader+OpenCV")
        crops = self.bench.crops("train")
        self.steady(
            "train",
            ("--cache-memory", str(self.sizes.decoded_full)),
            lambda stack: self.bench.dataloader_contender(stack, DL_OPENCV, self.cfg.batch_size, crops),
            TRAIN_TARGET,
        )

    def eval_(self) -> None:
        say(f"(o) eval: a cache of {self.sizes.final_full / MIB:.0f} MiB against DataLoader+OpenCV (eval)")
        crops: OpenCVCrops = self.bench.crops("eval")
        self.steady(
            "eval",
            ("--augment", "eval", "--cache-memory", str(self.sizes.final_full)),
            lambda stack: self.bench.dataloader_contender(stack, DL_OPENCV, self.cfg.batch_size, crops),
            EVAL_TARGET,
        )

    def pipeline(self) -> None:
        cfg = self.cfg
        spec = pipeline_spec()
        dataset = PipelineSamples(self.bench.data.root, spec, cfg.seed)
        say(f"(o) pipeline {H_PIPELINE}: a cache of {self.sizes.decoded_full / MIB:.0f} MiB")

        def dataloader(stack: contextlib.ExitStack) -> Contender:
            loader = make_pipeline_dataloader(dataset, cfg.workers, cfg.batch_size, cfg.timeout)
            backlog = DATALOADER_PREFETCH * cfg.workers
            contender = Contender(DL_PIPELINE, loader_stream(loader), backlog, cfg.warmup_batches)
            stack.callback(contender.close)
            contender.pull()
            return contender

        def identical(service: ServiceProcess) -> dict[str, Any]:
            found = measure_identical(service.spec.endpoint, dataset, cfg.timeout)
            same = found.samples[SERVICE]
            self.add(
                Verdict(
                    "pipeline: samples from the cache identical to the DataLoader's",
                    f"{int(sum(same))}/{len(same)} of one batch",
                    "all",
                    sum(same) == len(same),
                )
            )
            return {"identical": list(same)}

        args = ("--pipeline", spec, "--cache-memory", str(self.sizes.decoded_full))
        self.steady("pipeline", args, dataloader, PIPELINE_TARGET, identical)

    # --- first: the epoch that fills the cache ---------------------------------------------------------

    def first_epochs(
        self, part: str, variants: Sequence[tuple[str, tuple[str, ...]]]
    ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Images/s of each variant's first epoch, one fresh service each per round, timed in turn;
        and the CPU-seconds its process tree spent per 1000 images meanwhile."""
        cfg = self.cfg
        rates: dict[str, list[float]] = {key: [] for key, _ in variants}
        cpu: dict[str, list[float]] = {key: [] for key, _ in variants}
        bar = progress(f"(o) first epoch, {part}", self.plan.first_rounds * len(variants))
        for r in range(self.plan.first_rounds):
            with contextlib.ExitStack() as stack:
                services = {key: self.start(stack, f"first-{part}-{key}", args) for key, args in variants}
                for key, service in rotated(list(services.items()), r):
                    for other in services.values():  # started, warm start decoded, nothing running
                        until_settled(other.spec.endpoint, cfg.timeout, warm=True)
                    wait_idle()
                    pids = tree(service.pid)
                    cpu_before = cpu_seconds(pids)
                    seconds, images = first_epoch(service.spec.endpoint, cfg.timeout)
                    if images != self.bench.data.images:
                        raise BenchError(f"{part} {key}: epoch 0 held {images} images")
                    rates[key].append(rate(images, seconds))
                    cpu[key].append((cpu_seconds(pids) - cpu_before) / images * 1000)
                    bar.update()
                cached = services["cache"].spec.endpoint
                until_settled(cached, cfg.timeout, warm=False)
                status = cache_status(cached, cfg.timeout)
                if int(status["entries"]) != self.bench.data.images or status["full"]:
                    raise BenchError(f"first, {part}: the cache did not keep every sample: {status}")
        bar.close()
        return rates, cpu

    def first(self) -> None:
        sizes = self.sizes
        say("(o) first epoch: a cache filling against no cache (train, then eval)")
        train, train_cpu = self.first_epochs(
            "train",
            [
                ("cache", ("--cache-memory", str(sizes.decoded_full))),
                ("auto", ()),
                ("opencv", ("--decoder", "opencv")),
            ],
        )
        evals, eval_cpu = self.first_epochs(
            "eval",
            [
                ("cache", ("--augment", "eval", "--cache-memory", str(sizes.final_full))),
                ("auto", ("--augment", "eval")),
            ],
        )
        self.results["first"] = {
            "train": train,
            "eval": evals,
            "service_cpu_per_1000": {"train": train_cpu, "eval": eval_cpu},
        }
        rounds = self.plan.first_rounds
        for part, rates, cpu, other, target in (
            ("train", train, train_cpu, "auto", FIRST_TARGET),
            ("eval", evals, eval_cpu, "auto", FIRST_TARGET),
            ("train", train, train_cpu, "opencv", None),
        ):
            ratio = paired_ratio(rates["cache"], rates[other])
            decoder = "--decoder auto" if other == "auto" else "--decoder opencv, the same pixels"
            detail = (
                f"cache filling {median(rates['cache']) or 0:.0f} images/s, no cache ({decoder}) "
                f"{median(rates[other]) or 0:.0f}; median of {rounds} round(s); service CPU-s per 1000 "
                f"images {median(cpu['cache']) or 0:.2f} against {median(cpu[other]) or 0:.2f}"
            )
            self.add(ratio_verdict(f"first epoch, {part}, against no cache ({other})", ratio, detail, target))

    # --- half and memory: epochs 1.. on services side by side ------------------------------------------

    def per_epoch(self, half: bool, full: bool) -> None:
        """No cache, and a half cache and/or a cache holding all: epochs timed in turn, then per
        service the cache's counters and the memory of its tree, each settled."""
        cfg, bpe, sizes = self.cfg, self.bpe, self.sizes
        variants: list[tuple[str, tuple[str, ...]]] = [
            (NO_CACHE, ()),
            (NO_CACHE_OPENCV, ("--decoder", "opencv")),
        ]
        if half:
            variants.append((HALF, ("--cache-memory", str(sizes.decoded_half))))
        if full:
            variants.append((FULL, ("--cache-memory", str(sizes.decoded_full))))
        keys = [key for key, _ in variants]
        epochs = self.plan.half_epochs
        rates: dict[str, list[float]] = {key: [] for key in keys}
        cpu: dict[str, list[float]] = {key: [] for key in keys}
        hits: dict[str, list[float | None]] = {key: [] for key in keys if key in (HALF, FULL)}
        totals: dict[str, list[float]] = {key: [] for key in keys}
        anon: dict[str, list[float]] = {key: [] for key in keys}
        shm: dict[str, list[float]] = {key: [] for key in keys}
        statuses: dict[str, list[dict[str, Any]]] = {key: [] for key in hits}
        say(f"(o) {epochs} epochs on services with caches {', '.join(keys)}, timed in turn")
        bar = progress("(o) epochs per service", epochs * len(keys))
        with contextlib.ExitStack() as stack:
            services = {key: self.start(stack, f"epochs-{key}", args) for key, args in variants}
            readers = {key: self.bench.service_contender(stack, s) for key, s in services.items()}
            for service in services.values():  # the warm start done: epoch 1 begins alike everywhere
                until_settled(service.spec.endpoint, cfg.timeout, warm=True)
            # From zero: the warm start decodes epoch 1's first batches, part of epoch 1's window.
            before: dict[str, Mapping[str, Any]] = {key: {"hits": 0, "misses": 0} for key in hits}
            for epoch in range(epochs):
                for key in rotated(keys, epoch):
                    pids = tree(services[key].pid)
                    cpu_before = cpu_seconds(pids)
                    seconds, images = time_epoch(readers[key], bpe)
                    rates[key].append(rate(images, seconds))
                    cpu[key].append((cpu_seconds(pids) - cpu_before) / images * 1000)
                    bar.update()
                for key, service in services.items():
                    until_settled(service.spec.endpoint, cfg.timeout, warm=False)
                    used = memory(tree(service.pid))
                    anon[key].append(used.rss_anon_mib)
                    shm[key].append(shm_mib(service.pid))
                    totals[key].append(used.rss_anon_mib + shm[key][-1])
                    if key in hits:
                        now = cache_status(service.spec.endpoint, cfg.timeout)
                        hits[key].append(hit_ratio(before[key], now))
                        statuses[key].append(now)
                        before[key] = now
        bar.close()
        cache_mib = {HALF: sizes.decoded_half / MIB, FULL: sizes.decoded_full / MIB}
        self.results["epochs"] = {
            "images_per_second": rates,
            "service_cpu_per_1000": cpu,
            "hit_ratio": hits,
            "cache_status": statuses,
            "rss_anon_mib": anon,
            "shm_mib": shm,
            "anon_plus_shm_mib": totals,
            "cache_mib": {key: cache_mib[key] for key in hits},
        }
        if half:
            self.report_half(rates, hits[HALF], statuses[HALF])
        for key in hits if full else ():
            self.report_memory(key, totals, anon, shm, cache_mib[key])

    def report_half(
        self,
        rates: Mapping[str, Sequence[float]],
        hits: Sequence[float | None],
        statuses: Sequence[Mapping[str, Any]],
    ) -> None:
        looked_up = 0
        for epoch, (hit, status) in enumerate(zip(hits, statuses, strict=True), 1):
            lookups = int(status["hits"]) + int(status["misses"]) - looked_up
            looked_up += lookups
            mine, none, opencv = (rates[k][epoch - 1] for k in (HALF, NO_CACHE, NO_CACHE_OPENCV))
            self.add(
                Verdict(
                    f"half cache, epoch {epoch}: hit ratio; speed-up against no cache (auto, opencv)",
                    f"hits {percent(hit)} of {lookups} lookups; {mine / none:.2f}x, {mine / opencv:.2f}x "
                    f"({mine:.0f} against {none:.0f}, {opencv:.0f} images/s)",
                )
            )

    def report_memory(
        self,
        key: str,
        totals: Mapping[str, Sequence[float]],
        anon: Mapping[str, Sequence[float]],
        shm: Mapping[str, Sequence[float]],
        cache_mib: float,
    ) -> None:
        """Against no cache (the target) and, for context, against no cache decoding whole images."""
        mine = totals[key]
        name = "a cache holding all" if key == FULL else "a half cache"
        for baseline in (NO_CACHE, NO_CACHE_OPENCV):
            none = totals[baseline]
            excess = memory_excess(mine, none, cache_mib)
            allowance = memory_allowance(none)
            decoder = "auto" if baseline == NO_CACHE else "opencv"
            value = (
                f"with {name} {max(mine):.0f} MiB (anon {max(anon[key]):.0f} + shm {max(shm[key]):.0f}), "
                f"without ({decoder}) {max(none):.0f} MiB (anon {max(anon[baseline]):.0f} + shm "
                f"{max(shm[baseline]):.0f}), cache {cache_mib:.0f} MiB: {excess:+.1f} MiB past their sum"
            )
            title = f"memory after each of {len(mine)} epochs, {name}, against no cache ({decoder})"
            if baseline == NO_CACHE:
                target = f"<= cache + none + {allowance:.0f} MiB"
                self.add(Verdict(title, value, target, excess <= allowance))
            else:
                self.add(Verdict(title, value))


def compute_sizes(cfg: BenchConfig, data: DataSpec) -> CacheSizes:
    index = build_index(data.root)
    decoded = decoded_sizes(index)
    final = sum(math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in image_fields(cfg.image_size))
    return CacheSizes(
        decoded_data=sum(decoded),
        decoded_full=cache_bytes(decoded, cfg.workers, margin=MARGIN_BYTES),
        decoded_half=cache_bytes(decoded, cfg.workers, share=0.5),
        final_full=cache_bytes([final] * len(index), cfg.workers, margin=MARGIN_BYTES),
    )


def run(args: argparse.Namespace, parts: Sequence[str]) -> dict[str, Any]:
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.images:
        plan = replace(plan, images=args.images)
    cfg = make_config(args.quick, images=plan.images, interpolations=(INTERPOLATION,))
    begin = time.monotonic()
    load_before = os.getloadavg()
    skipped: dict[str, str] = {}
    if "pipeline" in parts and (problem := torchvision_problem()):
        skipped["pipeline"] = problem
        print(f"(o) pipeline | skipped: {problem} | target >= {PIPELINE_TARGET:g}x | -", flush=True)
    cv2.setNumThreads(1)  # this process decodes only to size the caches; the workers do the rest
    generation = LazyProgress("generating the sample dataset")
    data = prepare_data(cfg, progress=generation)
    generation.close()
    say(data.describe())
    sizes = compute_sizes(cfg, data)
    say(
        f"decoded size {sizes.decoded_data / MIB:.0f} MiB: caches of {sizes.decoded_full / MIB:.0f} (all), "
        f"{sizes.decoded_half / MIB:.0f} (half), {sizes.final_full / MIB:.0f} MiB (eval, all)"
    )
    with tempfile.TemporaryDirectory(prefix="dataferry-cache-bench-") as scratch:
        bench = BenchRun(cfg, data, Path(scratch))
        runner = Cache(bench, plan, sizes)
        steps: dict[str, Callable[[], None]] = {
            "train": runner.train,
            "eval": runner.eval_,
            "pipeline": runner.pipeline,
            "first": runner.first,
        }
        for part in parts:
            if part in steps and part not in skipped:
                steps[part]()
        if "half" in parts or "memory" in parts:
            runner.per_epoch(half="half" in parts, full="memory" in parts)
    left = sum(len(service_segments(s.pid)) for s in bench.services)
    return {
        "plan": asdict(plan),
        "settings": {
            "workers": cfg.workers,
            "batch_size": cfg.batch_size,
            "image_size": cfg.image_size,
            "interpolation": INTERPOLATION,
            "seed": cfg.seed,
            "quick": cfg.quick,
            "parts": list(parts),
            "pipeline": H_PIPELINE,
        },
        "data": data.public(),
        "cache_bytes": asdict(sizes),
        "machine": machine_facts(),
        "results": runner.results,
        "lines": [asdict(v) for v in runner.verdicts],
        "skipped": skipped,
        "cleanup": {"service_exit_codes": [s.exit_code for s in bench.services], "segments_left": left},
        "seconds": time.monotonic() - begin,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="where cache.json goes")
    parser.add_argument("--quick", action="store_true", help="a small dataset, fewer epochs and rounds")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)"
    )
    parser.add_argument("--images", type=int, default=0, help="size of the generated dataset (default 2560)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    return run_benchmark(
        "python -m benchmarks.cache",
        lambda: run(args, [p for p in PARTS if p in parts]),
        partial(_write, args.out),
    )


def _write(out: Path, results: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cache.json"
    path.write_text(json.dumps(results, indent=2))
    say(f"wrote {path} ({results['seconds'] / 60:.1f} minutes)")


if __name__ == "__main__":
    sys.exit(main())
