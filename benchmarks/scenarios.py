"""Scenarios (a), (c)-(g), and the one-trainer rounds of (h) and (i), each driving contenders that
``run`` has set up. (b) and (h)'s group are in ``trainers``, (j) in ``remote``.

Every scenario returns ``Measurement``s holding each repeat; medians and ratios are taken later, in
one place (``results``, ``stats``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.utils.data import Dataset

from benchmarks.contenders import Contender
from benchmarks.datasets import Sample, make_dataloader
from benchmarks.proctree import cpu_seconds, memory, shm_mib, tree
from benchmarks.progress import progress
from benchmarks.results import Measurement, Timeline
from benchmarks.service_process import BenchError
from benchmarks.stats import overlap_ratio, rate
from gpu_worker import ServiceLoader
from loader_service.supervisor.streams.early import WARM_PLAN
from loader_service.tools.status_view import query_status

FILL_MARGIN = 1.5
"""(e) waits this many times the estimated decode time, so the batches timed are really waiting."""
IDLE_CORES = 0.2
"""Below this much CPU (in cores) the benchmark's process tree counts as idle."""
COLD_EPOCH = 1000
"""(c) cold: the first of the epochs its trainers start, one each: no cache of the service holds them
(the warm start keeps epoch ``WARM_PLAN[0]``; a stream's batches decoded ahead are its own)."""
VARIANT_SEP = "@"
"""(a), (f): a contender timed at one of several filters is the series ``KEY@FILTER`` in the rounds."""
T = TypeVar("T")


@dataclass(frozen=True)
class Segment:
    images: int
    seconds: float
    cpu_seconds: float
    timeline: Timeline


def wait_idle(cores: float = IDLE_CORES, interval: float = 0.2, timeout: float = 10.0) -> None:
    """Return once this process and its descendants use less than ``cores`` CPU over ``interval`` s.

    A contender that just stopped being timed goes on filling its credits or prefetch queue; timing
    the next contender meanwhile would charge it that CPU and give it fewer cores. Other users'
    processes are not in the tree, so a busy machine does not keep this waiting (``timeout`` caps it).
    """
    pids = tree(os.getpid())
    deadline = time.monotonic() + timeout
    before, start = cpu_seconds(pids), time.perf_counter()
    while time.monotonic() < deadline:
        time.sleep(interval)
        used, now = cpu_seconds(pids), time.perf_counter()
        if (used - before) / (now - start) < cores:
            return
        before, start = used, now


def time_segment(contender: Contender, batches: int) -> Segment:
    """Wait for the tree to idle, skip what may be buffered plus a warm-up, then time ``batches`` batches.

    CPU is counted over this process and every descendant (service, decode workers, DataLoader
    workers): contenders not being timed sit idle, blocked on their queues.
    """
    wait_idle()
    for _ in range(contender.backlog + contender.warmup):
        contender.pull()
    pids = tree(os.getpid())
    cpu_before = cpu_seconds(pids)
    start = time.perf_counter()
    ends, images, waits = [], [], []
    for _ in range(batches):
        tick, waited = contender.timed_pull()
        ends.append(time.perf_counter() - start)
        images.append(tick.images)
        waits.append(waited)
    seconds = time.perf_counter() - start
    timeline = Timeline(tuple(ends), tuple(images), tuple(waits))
    return Segment(sum(images), seconds, cpu_seconds(pids) - cpu_before, timeline)


@dataclass(frozen=True)
class Rounds:
    """Per contender, one value per round: images/s, CPU-seconds per 1000 images, and the timeline."""

    rates: dict[str, list[float]]
    cpu_per_1000: dict[str, list[float]]
    timelines: dict[str, Timeline]


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` starting at position ``r`` (mod its length): round ``r``'s order."""
    return [*items[r % len(items) :], *items[: r % len(items)]]


def interleaved_rounds(
    contenders: Sequence[Contender],
    rounds: int,
    batches: int,
    label: str,
    names: Sequence[str] | None = None,
) -> Rounds:
    """``rounds`` rounds, each timing every contender once (``time_segment``), the order rotating;
    each contender's series is named by ``names`` (default: its key).

    Interleaving puts every contender under the same background load within a round, which is what
    makes the per-round ratios comparable on a shared machine.
    """
    named = list(zip(names or [c.key for c in contenders], contenders, strict=True))
    rates: dict[str, list[float]] = {name: [] for name, _ in named}
    cpu: dict[str, list[float]] = {name: [] for name, _ in named}
    timelines = {name: Timeline() for name, _ in named}
    bar = progress(label, rounds * len(named))
    for r in range(rounds):
        for name, c in rotated(named, r):
            segment = time_segment(c, batches)
            rates[name].append(rate(segment.images, segment.seconds) * c.scale)
            cpu[name].append(segment.cpu_seconds / max(1, segment.images) * 1000)
            timelines[name] = timelines[name].then(segment.timeline)
            bar.update()
    bar.close()
    return Rounds(rates, cpu, timelines)


def variant_key(key: str, variant: str) -> str:
    """The series of contender ``key`` at filter ``variant``; ``key`` itself for one timed once for all."""
    return f"{key}{VARIANT_SEP}{variant}" if variant else key


def of_variant(series: Mapping[str, T], variant: str, shared: bool = True) -> dict[str, T]:
    """One filter's series out of rounds that timed several: ``KEY@variant`` as ``KEY``, and, with
    ``shared``, every series timed once for all filters (no ``@``), in the order timed."""
    out = {}
    for name, value in series.items():
        key, sep, at = name.partition(VARIANT_SEP)
        if (sep and at == variant) or (shared and not sep):
            out[key] = value
    return out


def measure_throughput(
    timed: Sequence[tuple[Contender, str]], variants: Sequence[str], rounds: int, batches: int
) -> tuple[list[Measurement], dict[str, Timeline]]:
    """(a) and (f): interleaved rounds of every contender, each paired with the filter it runs ("":
    one timed once for all, as DataLoader+PIL). A measurement of each per filter in ``variants``:
    keys ``a`` and ``f`` for the first (the run's main filter), ``a-FILTER``, ``f-FILTER`` for the
    others, each holding the shared series too, so that its ratios pair the same rounds. Timelines
    ``KEY:CONTENDER``, the shared ones under the first filter only."""
    names = [variant_key(c.key, v) for c, v in timed]
    got = interleaved_rounds([c for c, _ in timed], rounds, batches, "(a, f) throughput rounds", names)
    measured: list[Measurement] = []
    timelines: dict[str, Timeline] = {}
    for i, v in enumerate(variants):
        suffix = f"-{v}" if i else ""
        rates, cpu = of_variant(got.rates, v), of_variant(got.cpu_per_1000, v)
        measured += [
            Measurement("a", f"a{suffix}", "one trainer, steady state", "images/s", rates, True, variant=v),
            Measurement("f", f"f{suffix}", "CPU-seconds per 1000 images", "CPU-s", cpu, True, variant=v),
        ]
        own = of_variant(got.timelines, v, shared=not i)
        timelines.update({f"a{suffix}:{k}": t for k, t in own.items()})
    return measured, timelines


def measure_rates(
    contenders: Sequence[Contender], rounds: int, batches: int, scenario: str, title: str
) -> tuple[Measurement, Measurement, dict[str, Timeline]]:
    """(h), (i): interleaved rounds as (a)'s; images/s (key ``scenario``) and CPU-seconds per 1000
    images (``scenario-cpu``) of each contender, the first contender's series first."""
    got = interleaved_rounds(contenders, rounds, batches, f"({scenario}) {title} rounds")
    rates = Measurement(scenario, scenario, title, "images/s", got.rates, paired=True)
    cpu_title = "CPU-seconds per 1000 images, all processes"
    cpu = Measurement(scenario, f"{scenario}-cpu", cpu_title, "CPU-s", got.cpu_per_1000, paired=True)
    return rates, cpu, got.timelines


def settled(status: Mapping[str, Any], warm: bool) -> bool:
    """Nothing being decoded: every worker up and without a task, no slot of any feed filling; with
    ``warm``, the first feed's warm-start batches ready too (NOTE [ Warm start ])."""
    workers, feeds = status.get("worker_list") or [], status.get("feeds") or []
    if not workers or not feeds:
        return False
    idle = all(w.get("ready") and w.get("task") is None for w in workers)
    quiet = all(f.get("slots", {}).get("filling", 1) == 0 for f in feeds)
    return idle and quiet and (not warm or feeds[0].get("slots", {}).get("ready", 0) >= 1)


def until_settled(endpoint: str, timeout: float, warm: bool) -> None:
    """Wait until the service has ``settled`` after the previous trainer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if settled(query_status(endpoint, timeout), warm):
            return
        time.sleep(0.02)  # polling a remote state: there is no event to wait on
    raise BenchError(f"the service at {endpoint} did not settle within {timeout:.0f} s")


def first_batch_service(endpoint: str, repeats: int, timeout: float, cold: bool = False) -> list[float]:
    """(c): seconds from constructing a ServiceLoader to holding its first batch, each attach on a
    settled service (every worker idle, nothing being decoded).

    Warm: the trainer starts epoch 0 at position 0 as rank 0 of 1, the plan the warm start keeps
    decoded (the target's case). ``cold``: each trainer starts an epoch of its own from
    ``COLD_EPOCH`` on, which nothing has decoded, so its first batch is decoded after it asks; the
    batch's epoch is checked. One untimed attach first, so the service has served a trainer before
    the timed ones.
    """
    times = []
    bar = progress(f"(c) first batch, service ({'cold' if cold else 'warm'})", repeats)
    for attempt in range(repeats + 1):
        epoch = COLD_EPOCH + attempt if cold else WARM_PLAN[0]
        until_settled(endpoint, timeout, warm=not cold)
        start = time.perf_counter()
        with ServiceLoader(endpoint, device="cpu", timeout=timeout, connect_timeout=timeout) as loader:
            loader.set_epoch(epoch)
            batch = next(iter(loader))
            took = time.perf_counter() - start
            got = batch.epoch
            del batch  # before close: a batch must not outlive its loader
        if got != epoch:
            raise BenchError(f"(c) asked for epoch {epoch}, got a batch of epoch {got}")
        if attempt:
            times.append(took)
            bar.update()
    bar.close()
    return times


def first_batch_dataloader(
    dataset: Dataset[Sample], workers: int, batch_size: int, repeats: int, timeout: float
) -> list[float]:
    """(c), for context: a fresh DataLoader's construction to first batch (it starts its workers)."""
    times = []
    bar = progress("(c) first batch, DataLoader", repeats)
    for _ in range(repeats):
        start = time.perf_counter()
        loader = make_dataloader(dataset, workers, batch_size, timeout)
        batches = iter(loader)
        batch = next(batches)
        times.append(time.perf_counter() - start)
        del batch, batches, loader  # shuts its persistent workers down
        bar.update()
    bar.close()
    return times


def _step_epoch(
    c: Contender, batches_per_epoch: int, compute: float, origin: float
) -> tuple[float, Timeline]:
    """One epoch of ``next()`` then a sleeping step per batch; its seconds and per-batch timeline."""
    start = time.perf_counter()
    ends, images, waits = [], [], []
    for position in range(batches_per_epoch):
        tick, waited = c.timed_pull()
        if tick.position != position:
            raise BenchError(f"{c.key}: expected batch {position} of an epoch, got {tick.position}")
        time.sleep(compute)  # the accelerator's step: the CPU is free meanwhile
        ends.append(time.perf_counter() - origin)
        images.append(tick.images)
        waits.append(waited)
    return time.perf_counter() - start, Timeline(tuple(ends), tuple(images), tuple(waits))


def measure_overlap(
    contenders: Sequence[Contender],
    loads: dict[str, float],
    compute: float,
    epochs: int,
    batches_per_epoch: int,
) -> tuple[Measurement, dict[str, Timeline]]:
    """(d): epochs with a simulated step of ``compute`` s; epoch time / (batches x max(load, compute))."""
    ratios: dict[str, list[float]] = {c.key: [] for c in contenders}
    timelines = {}
    bar = progress("(d) epochs with a simulated step", epochs * len(contenders))
    for c in contenders:
        c.finish_epoch(batches_per_epoch)
        wait_idle()
        origin = time.perf_counter()
        timeline = Timeline()
        for _ in range(epochs):
            seconds, epoch_timeline = _step_epoch(c, batches_per_epoch, compute, origin)
            timeline += epoch_timeline
            ratios[c.key].append(overlap_ratio(seconds, batches_per_epoch, loads[c.key], compute))
            bar.update()
        timelines[c.key] = timeline
    bar.close()
    notes = {"compute_s": compute, **{f"load_s_{k}": v for k, v in loads.items()}}
    return Measurement("d", "d", "epoch / max(load, compute)", "x", ratios, notes=notes), timelines


def fill_seconds(ready: int, workers: int, batch_size: int, per_image: float) -> float:
    """How long ``ready`` batches take to decode on ``workers`` processes, with a safety margin."""
    return math.ceil(ready / workers) * batch_size * per_image * FILL_MARGIN + 0.25


def ready_costs(
    c: Contender, ready: int, fill: float, epochs: int, batches_per_epoch: int, batch_size: int
) -> list[float]:
    """(e): microseconds inside ``next()`` for batches already waiting when it is called.

    Per epoch: take batch 0 (decoded on demand), sleep ``fill`` s so the next ``ready`` batches are
    decoded and delivered, take one of them untimed (the first call after a long pause pays for
    caches the pause let go cold, which a loop busy with its step would not), then time the rest.
    Each timed call receives one batch, wraps it and drops it (a service slot's release goes out with
    the following call). Short batches are not counted.
    """
    costs = []
    for _ in range(epochs):
        c.finish_epoch(batches_per_epoch)
        c.pull()
        time.sleep(fill)
        c.pull()
        for _ in range(min(ready, batches_per_epoch - 1) - 1):
            tick, took = c.timed_pull()
            if tick.images == batch_size:
                costs.append(took * 1e6)
    return costs


def measure_memory(c: Contender, service_pid: int, epochs: int, batches_per_epoch: int) -> Measurement:
    """(g): after each of ``epochs`` epochs, the service tree's resident memory and its /dev/shm use."""
    rss, anon, shm = [], [], []
    c.finish_epoch(batches_per_epoch)
    bar = progress("(g) epochs with memory samples", epochs)
    for _ in range(epochs):
        for _ in range(batches_per_epoch):
            c.pull()
        used = memory(tree(service_pid))
        rss.append(used.rss_mib)
        anon.append(used.rss_anon_mib)
        shm.append(shm_mib(service_pid))
        bar.update()
    bar.close()
    samples = {"rss_mib": rss, "rss_anon_mib": anon, "shm_mib": shm}
    return Measurement("g", "g", "service memory after each epoch", "MiB", samples)
