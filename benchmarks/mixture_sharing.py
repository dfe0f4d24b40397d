"""Two jobs with different weights over the same sources on one service: how much decode they share
(issue 38), with the sample cache off and on, against a broadcast group and one job alone.

    python -m benchmarks.mixture_sharing [--images N] [--workers N] [--quick] [--json F]

The generated sample dataset is split into the three ImageFolders of ``benchmarks.mixture``
(``make_sources``: 50/30/20 % of the images, class by class). Every case starts a fresh
``loader-service serve --source a=... --source b=... --source c=...`` (``--workers`` processes,
``--augment train`` at 224, batches of ``BATCH``), waits until its warm start is done, then attaches
its jobs at once: each a ``ServiceLoader`` in a thread of its own, reading one epoch of ``images``
samples (``epoch_samples``) with its weights. The cases (``CASES``):

* ``alone``, ``alone_cache``: job 1 (0.6/0.3/0.1) by itself, the cache off and on;
* ``two``, ``two_cache``: job 1 and job 2 (0.1/0.3/0.6) at the same time, the cache off and on
  (``--cache-memory`` enough for every decoded image of the dataset, with a margin);
* ``same_cache``: two jobs with job 1's weights, each in its own shard stream, the cache on;
* ``broadcast``: two members of a broadcast group (``mode="broadcast", group_size=2``) with job 1's
  weights: the group's one order, decoded once for both by design.

Counted from the service's status, from just before the jobs attach to the moment the service is
idle again after they left: the rows the workers filled (``decoded``, the warm start's taken
out), the cache's hits among them, and so the images decoded from their files (filled minus hits).
The jobs count the rows they got, and which samples (source, index) those were. Reported per case:
decodes per delivered row, that is (file decodes + decoded images the cache already held when the
jobs attached, from the warm start) / rows delivered to all jobs (1.0: every row decoded for its
job; 0.5: every sample decoded once for two jobs); its floor, the distinct samples the jobs read
per delivered row (what a cache that kept everything would decode); the cache misses that stored
nothing, each a sample another worker was decoding at the same moment ("twice at once": a source
with the same weight in both jobs is read by both in the same order at the same pace, its order
being keyed by the seed, the source and the pass alone); the rows filled but never delivered (the
next epoch's first batches, which a shard stream decodes ahead while its job ends an epoch: this
benchmark's jobs read one epoch and leave, so those count against them); and each case's wall
time. A count, not a timing: machine noise moves the wall times, and the figures only through
the samples decoded twice at once and the batches decoded ahead.
The table goes to stdout, progress to stderr, everything to ``--json``. Exit code 0: it ran;
1: a process failed or timed out; 2: a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cache import cache_bytes
from benchmarks.cli import run_benchmark
from benchmarks.config import BenchConfig, ConfigError
from benchmarks.mixture import DECODER, NAMES, SIZE, Sources, setting, split
from benchmarks.progress import say
from benchmarks.run import SERVICE_CREDITS
from benchmarks.service_process import BenchError, ServiceProcess, ServiceSpec, running_service
from loader_service.dataset.index import build_index
from loader_service.decode.cache import entry_bytes
from loader_service.tools.cache_size import image_pixels
from loader_service.tools.status_view import query_status

BATCH = 16
"""Small batches: an epoch of the quick dataset is still 12 of them."""
JOB1 = (0.6, 0.3, 0.1)
JOB2 = (0.1, 0.3, 0.6)
CACHE_MARGIN = 1.02
"""``--cache-memory`` over what every decoded image takes: nothing may be left out for lack of room."""
STATUS_TIMEOUT = 10.0
SETTLE_QUIET = 0.5
"""Seconds the feed's ``decoded`` must stay unchanged, nothing filling, for the service to be idle."""
SETTLE_TIMEOUT = 30.0
GROUP = "sharing"


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    jobs: tuple[tuple[float, ...], ...]
    """Each job's weights over ``NAMES``."""
    cache: bool
    broadcast: bool = False


CASES = (
    Case("alone", "one job alone, cache off", (JOB1,), cache=False),
    Case("alone_cache", "one job alone, cache on", (JOB1,), cache=True),
    Case("two", "two jobs, cache off", (JOB1, JOB2), cache=False),
    Case("two_cache", "two jobs, cache on", (JOB1, JOB2), cache=True),
    Case("same_cache", "two jobs, same weights, cache on", (JOB1, JOB1), cache=True),
    Case("broadcast", "two jobs, same weights, broadcast group", (JOB1, JOB1), cache=False, broadcast=True),
)


@dataclass(frozen=True)
class Plan:
    images: int = 512
    workers: int = 2
    seed: int = 0
    timeout: float = 60.0
    quick: bool = False


QUICK = {"images": 192}
"""What ``--quick`` changes: 12 batches of 16 an epoch; a check that everything runs."""


# --- the jobs ------------------------------------------------------------------------------------------


@dataclass
class JobResult:
    """What one job got: rows, rows by source, and the distinct samples (source, index) among them."""

    weights: tuple[float, ...]
    rows: int = 0
    by_source: list[int] = field(default_factory=lambda: [0] * len(NAMES))
    samples: set[tuple[int, int]] = field(default_factory=set)
    error: BaseException | None = None


def read_one_epoch(
    endpoint: str,
    case: Case,
    weights: tuple[float, ...],
    plan: Plan,
    start: threading.Barrier,
    out: JobResult,
) -> None:
    """A trainer: attach, wait for the other jobs to attach, read one epoch, leave. Runs in a thread;
    a failure is kept in ``out.error`` and breaks the barrier, so the other jobs stop waiting."""
    from gpu_worker import ServiceLoader

    try:
        loader = ServiceLoader(
            endpoint,
            device="cpu",
            timeout=plan.timeout,
            credits=SERVICE_CREDITS,
            weights=dict(zip(NAMES, weights, strict=True)),
            epoch_samples=plan.images,
            mode="broadcast" if case.broadcast else "shard",
            group=GROUP if case.broadcast else "default",
            group_size=len(case.jobs) if case.broadcast else 1,
        )
        try:
            if tuple(loader.sources) != NAMES:
                raise BenchError(f"the feed's sources are {loader.sources}, not {NAMES}")
            start.wait(plan.timeout)
            loader.set_epoch(0)
            for batch in loader:
                sources = batch.sources.numpy().copy()
                indices = batch.indices.numpy().copy()
                del batch  # its credit goes back before the next is awaited
                out.rows += len(sources)
                for s, count in enumerate(np.bincount(sources, minlength=len(NAMES))[: len(NAMES)]):
                    out.by_source[s] += int(count)
                out.samples.update(zip(sources.tolist(), indices.tolist(), strict=True))
        finally:
            loader.close()
    except BaseException as exc:
        out.error = exc
        start.abort()


def run_jobs(endpoint: str, case: Case, plan: Plan) -> tuple[list[JobResult], float]:
    """Every job of ``case`` in a thread of its own, started together; their results and the wall
    time from the moment all had attached to the moment the last one left."""
    results = [JobResult(w) for w in case.jobs]
    start = threading.Barrier(len(case.jobs) + 1)
    threads = [
        threading.Thread(
            target=read_one_epoch,
            args=(endpoint, case, w, plan, start, out),
            name=f"job{i + 1}",
            daemon=True,  # a job stuck on a killed service must not keep the benchmark alive
        )
        for i, (w, out) in enumerate(zip(case.jobs, results, strict=True))
    ]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(plan.timeout + 30)
    began = time.monotonic()
    for t in threads:
        t.join(plan.timeout * 4)
    took = time.monotonic() - began
    for i, (t, out) in enumerate(zip(threads, results, strict=True)):
        if out.error is not None and not isinstance(out.error, threading.BrokenBarrierError):
            raise BenchError(
                f"{case.key}, job {i + 1}: {type(out.error).__name__}: {out.error}"
            ) from out.error
        if t.is_alive():
            raise BenchError(
                f"{case.key}, job {i + 1}: still reading {plan.timeout * 4:.0f} s after the start"
            )
    if any(out.error is not None for out in results):
        raise BenchError(f"{case.key}: the jobs could not all attach")
    return results, took


# --- the service's counts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """One feed's counters in a status reading."""

    decoded: int
    warm: int
    hits: int
    misses: int
    entries: int
    full: bool
    lock_timeouts: int
    served: int

    @classmethod
    def of(cls, status: Mapping[str, Any]) -> Counts:
        feed = status["feeds"][0]
        cache = feed.get("cache") or {}
        return cls(
            decoded=int(feed["decoded"]),
            warm=int(feed["warm_decoded"]),
            hits=int(cache.get("hits", 0)),
            misses=int(cache.get("misses", 0)),
            entries=int(cache.get("entries", 0)),
            full=bool(cache.get("full", False)),
            lock_timeouts=int(cache.get("lock_timeouts", 0)),
            served=sum(int(s["served"]) for s in feed["sources"]),
        )


def settled(endpoint: str, timeout: float = SETTLE_TIMEOUT) -> dict[str, Any]:
    """The status once the service is idle: no slot filling, no worker on a task, and the feed's
    ``decoded`` unchanged for ``SETTLE_QUIET`` seconds (a batch decoded ahead may still be in a worker
    when its job leaves)."""
    deadline = time.monotonic() + timeout
    last: int | None = None
    quiet_since = time.monotonic()
    while True:
        status = query_status(endpoint, STATUS_TIMEOUT)
        feed = status["feeds"][0]
        busy = feed["slots"].get("filling", 0) or any(
            w.get("task") is not None for w in status["worker_list"]
        )
        now = time.monotonic()
        if busy or feed["decoded"] != last:
            last, quiet_since = feed["decoded"], now
        elif now - quiet_since >= SETTLE_QUIET:
            return status
        if now > deadline:
            raise BenchError(f"the service was not idle within {timeout:.0f} s: {feed['slots']}")
        time.sleep(0.1)


def figures(
    case: Case, before: Counts, after: Counts, jobs: Sequence[JobResult], seconds: float
) -> dict[str, Any]:
    """A case's counts and ratios (module docstring). Pure."""
    filled = (after.decoded - before.decoded) - (after.warm - before.warm)
    hits = after.hits - before.hits
    file_decodes = filled - hits
    delivered = sum(j.rows for j in jobs)
    # A broadcast group's members get the same rows: each row filled once is delivered to every one.
    announced = max((j.rows for j in jobs), default=0) if case.broadcast else delivered
    distinct = len(set().union(*(j.samples for j in jobs)))
    decodes = file_decodes + before.entries
    return {
        "title": case.title,
        "jobs": [dict(zip(NAMES, j.weights, strict=True)) for j in jobs],
        "cache": case.cache,
        "broadcast": case.broadcast,
        "rows_delivered": delivered,
        "rows_by_job": [j.rows for j in jobs],
        "rows_by_source": [dict(zip(NAMES, j.by_source, strict=True)) for j in jobs],
        "rows_served_status": after.served - before.served,
        "filled": filled,
        "cache_hits": hits,
        "cache_misses": after.misses - before.misses,
        "cache_entries_at_start": before.entries,
        "cache_entries": after.entries,
        "cache_full": after.full,
        "cache_lock_timeouts": after.lock_timeouts - before.lock_timeouts,
        "decoded_twice": (after.misses - before.misses) - (after.entries - before.entries),
        "file_decodes": file_decodes,
        "not_delivered": filled - announced,
        "distinct_samples": distinct,
        "decodes_per_row": decodes / delivered if delivered else None,
        "floor_per_row": distinct / delivered if delivered else None,
        "seconds": seconds,
    }


# --- the run ---------------------------------------------------------------------------------------------


def full_cache_bytes(sources: Sources, workers: int) -> int:
    """``--cache-memory`` that keeps every decoded image of the sources (``benchmarks.cache``'s
    arithmetic on each image's height x width x 3, read from its header), with ``CACHE_MARGIN``."""
    sizes = []
    for name in NAMES:
        index = build_index(sources.folders[name])
        sizes += [3 * image_pixels(index.path(i).read_bytes()) for i in range(len(index))]
    need = cache_bytes(sizes, workers)
    return int(need * CACHE_MARGIN) + entry_bytes(max(sizes))


def run_case(
    case: Case, plan: Plan, sources: Sources, run_dir: Path, interpolation: str, cache: int
) -> tuple[dict[str, Any], ServiceProcess]:
    """One case on a fresh service, stopped cleanly after it (exit 0, no segment left) or killed with
    its group on any failure (NOTE [ Benchmark service lifecycle ])."""
    extra: tuple[str, ...] = ("--decoder", DECODER, "--interpolation", interpolation)
    if case.cache:
        extra += ("--cache-memory", str(cache))
    spec = ServiceSpec(
        sources.root,
        f"ipc://{run_dir}/{case.key}.sock",
        plan.workers,
        BATCH,
        SIZE,
        seed=plan.seed,
        extra_args=extra,
        sources=tuple((n, sources.folders[n]) for n in NAMES),
    )
    with running_service(spec, run_dir / f"{case.key}.log") as service:
        before = Counts.of(settled(spec.endpoint))
        jobs, seconds = run_jobs(spec.endpoint, case, plan)
        after = Counts.of(settled(spec.endpoint))
    got = figures(case, before, after, jobs, seconds)
    say(
        f"{case.key}: {got['rows_delivered']} rows delivered, {got['file_decodes']} decoded from files, "
        f"{got['cache_hits']} cache hits: {got['decodes_per_row']:.3f} decodes per row ({seconds:.1f} s)"
    )
    return got, service


def run(plan: Plan, data_cache: Path) -> dict[str, Any]:
    setup = setting(plan.images, plan.seed, data_cache)
    cases: dict[str, dict[str, Any]] = {}
    services: list[ServiceProcess] = []
    with split(setup, "dataferry-sharing-") as ready:
        assert ready.sources is not None and ready.run_dir is not None
        cache = full_cache_bytes(ready.sources, plan.workers)
        say(f"--cache-memory {cache} ({cache / 2**20:.0f} MiB: every decoded image, and a margin)")
        for case in CASES:
            say(f"{case.key}: {case.title}")
            cases[case.key], service = run_case(
                case, plan, ready.sources, ready.run_dir, ready.cfg.interpolation, cache
            )
            services.append(service)
    return setup.record(
        asdict(plan), services, batch_size=BATCH, credits=SERVICE_CREDITS, cache_memory=cache, cases=cases
    )


# --- output ----------------------------------------------------------------------------------------------


def _weights(jobs: Sequence[Mapping[str, float]]) -> str:
    return " + ".join("/".join(f"{w:g}" for w in job.values()) for job in jobs)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: Mapping[str, Any]) -> str:
    """The printed table: a row per case."""
    lines = [
        "| case | weights (a/b/c) | rows delivered | rows filled | cache hits | decoded from files "
        "| of them twice at once | filled, not delivered | decodes / delivered row | floor | wall s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in results["cases"].values():
        hits, twice = (str(c["cache_hits"]), str(c["decoded_twice"])) if c["cache"] else ("-", "-")
        lines.append(
            f"| {c['title']} | {_weights(c['jobs'])} | {c['rows_delivered']} | {c['filled']} | {hits} | "
            f"{c['file_decodes']} | {twice} | {c['not_delivered']} | {_num(c['decodes_per_row'], '.3f')} | "
            f"{_num(c['floor_per_row'], '.3f')} | {c['seconds']:.1f} |"
        )
    sizes = ", ".join(f"{k} {v}" for k, v in results["sources"].items())
    lines += [
        "",
        f"sources: {sizes} images; batches of {results['batch_size']}, one epoch of "
        f"{results['plan']['images']} samples per job; cache on: --cache-memory {results['cache_memory']}",
        "decodes / delivered row: (decoded from files + decoded images the cache held when the jobs "
        "attached) / rows delivered; floor: distinct samples read / rows delivered; twice at once: "
        "cache misses that stored nothing, the sample being decoded by another worker at the same moment",
    ]
    return "\n".join(lines)


def make_plan(args: argparse.Namespace) -> Plan:
    plan = replace(Plan(), **QUICK, quick=True) if args.quick else Plan()
    chosen = {k: getattr(args, k) for k in ("images", "workers")}
    plan = replace(plan, **{k: v for k, v in chosen.items() if v is not None})
    if plan.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if plan.images < 2 * BATCH:
        raise ConfigError(f"--images must be at least {2 * BATCH}")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mixture_sharing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--images", type=int, help="size of the generated dataset (default 512; quick 192)")
    parser.add_argument("--workers", type=int, help="decode processes of every service (default 2)")
    parser.add_argument(
        "--cache", type=Path, default=BenchConfig().cache, help="where generated datasets are kept"
    )
    parser.add_argument("--quick", action="store_true", help="a smaller dataset: checks the path")
    parser.add_argument(
        "--json", type=Path, default=Path("bench-results/mixture_sharing.json"), help="results file"
    )
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2

    def finish(results: dict[str, Any]) -> None:
        print(format_table(results), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        say(f"wrote {args.json} ({results['seconds']:.0f} s)")

    return run_benchmark(parser.prog, lambda: run(plan, args.cache), finish)


if __name__ == "__main__":
    sys.exit(main())
