"""The service main loop's own CPU cost per batch, with decoding taken out.

Starts a real service whose decode workers write nothing (``DATAFERRY_BENCH_WRITE_NOTHING=1``: each
task is answered at once with only the slot's sample indices) on a list of ``N`` entries whose files
need not exist (a list source does not open them), attaches ``T`` trainer processes that drop each
batch at once, and measures over a fixed wall time after a warm-up:

* batches delivered (summed over trainers) and batches decoded (the feed's status counter);
* the service process's CPU seconds: all its threads, and the main thread alone
  (``/proc/PID/task/PID/stat``; ZeroMQ's I/O threads are tasks of their own);
* the main thread's CPU per decoded batch and per delivery (a ``batch`` message out and its release
  in), and what one core could sustain: ``1 / (main-thread CPU per batch)``;
* the service's resident memory at the end.

Run ``python -m benchmarks.loop_cost``: shard mode (each trainer its own stream) and one broadcast
group of all trainers, on a small list (frequent epoch starts) and an ImageNet-sized one. The issue's
target: one core sustains >= 2000 batches/s of 64 at 8 trainers. The trainers and the service share
this machine's cores, so the delivered rate is what this machine managed, not what the loop could.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from benchmarks.proctree import PROC, parse_stat, parse_status_kib
from benchmarks.service_process import BenchError, ServiceProcess, ServiceSpec, running_service
from loader_service.decode.contract import BENCH_WRITE_NOTHING_ENV
from loader_service.tools.status_view import query_status

IMAGENET_SAMPLES = 1_281_167
TARGET_BATCHES_PER_SECOND = 2000.0
"""Issue 13: the loop must sustain this many batches of 64 at 8 trainers on one core."""
ATTACH_TIMEOUT = 120.0
"""Seconds for every trainer to import torch, attach and get its first batch (2 cores, 8 imports)."""
STATUS_TIMEOUT = 10.0


@dataclass(frozen=True)
class RunSpec:
    samples: int
    mode: str
    """``shard`` (every trainer its own stream) or ``broadcast`` (one group of every trainer)."""
    trainers: int
    seconds: float
    warmup: float
    workers: int
    batch_size: int
    image_size: int
    slots: int


@dataclass(frozen=True)
class RunResult:
    samples: int
    mode: str
    trainers: int
    seconds: float
    deliveries: int
    """Batches received, summed over trainers."""
    decoded: int
    """Batches the service planned and its workers answered (the feed's ``batches`` counter)."""
    main_cpu: float
    """CPU seconds of the service's main thread over the window."""
    process_cpu: float
    """CPU seconds of the whole service process (every thread) over the window."""
    rss_mib: float

    @property
    def us_per_batch(self) -> float:
        return 1e6 * self.main_cpu / self.decoded if self.decoded else float("inf")

    @property
    def us_per_delivery(self) -> float:
        return 1e6 * self.main_cpu / self.deliveries if self.deliveries else float("inf")

    @property
    def sustainable(self) -> float:
        """Decoded batches per second the main loop could keep up on one core."""
        return self.decoded / self.main_cpu if self.main_cpu else float("inf")

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "us_main_cpu_per_batch": round(self.us_per_batch, 1),
            "us_main_cpu_per_delivery": round(self.us_per_delivery, 1),
            "sustainable_batches_per_second": round(self.sustainable),
            "main_core_share": round(self.main_cpu / self.seconds, 3),
        }


# --- trainers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerSpec:
    trainer: int
    endpoint: str
    mode: str
    group_size: int
    timeout: float


def trainer_main(spec: TrainerSpec, counts: SynchronizedArray[int], stop: Event, errors: Queue[str]) -> None:
    """A trainer that drops every batch at once, counting it in ``counts[trainer]``, until ``stop``."""
    try:
        from gpu_worker import ServiceLoader

        kwargs: dict[str, Any] = {"device": "cpu", "timeout": spec.timeout, "mode": spec.mode}
        if spec.mode == "broadcast":
            kwargs.update(group="loop-cost", group_size=spec.group_size)
        with ServiceLoader(spec.endpoint, **kwargs) as loader:
            while not stop.is_set():
                for batch in loader:
                    del batch  # released before the next is asked for
                    counts[spec.trainer] += 1
                    if stop.is_set():
                        break
    except BaseException:
        errors.put(f"trainer {spec.trainer} (pid {os.getpid()}):\n{traceback.format_exc()}")


@contextlib.contextmanager
def trainers(endpoint: str, spec: RunSpec) -> Iterator[tuple[SynchronizedArray[int], Queue[str]]]:
    """``spec.trainers`` trainer processes for the ``with`` body; stopped and reaped after it."""
    ctx = mp.get_context("spawn")
    counts: SynchronizedArray[int] = ctx.Array("q", spec.trainers, lock=False)
    stop, errors = ctx.Event(), ctx.Queue()
    procs: list[BaseProcess] = []
    try:
        for i in range(spec.trainers):
            t = TrainerSpec(i, endpoint, spec.mode, spec.trainers, timeout=ATTACH_TIMEOUT)
            procs.append(ctx.Process(target=trainer_main, args=(t, counts, stop, errors), daemon=True))
            procs[-1].start()
        yield counts, errors
    finally:
        stop.set()
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _check_trainers(errors: Queue[str]) -> None:
    """Fail the run with the first trainer's traceback, if one failed."""
    try:
        error = errors.get_nowait()
    except queue.Empty:
        return
    raise BenchError(error)


def _await_first_batches(counts: SynchronizedArray[int], errors: Queue[str], service: ServiceProcess) -> None:
    deadline = time.monotonic() + ATTACH_TIMEOUT
    while min(counts[:]) == 0:
        _check_trainers(errors)
        if service.proc.poll() is not None:
            raise BenchError(f"service exited with {service.proc.returncode}:\n{service.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"trainers got no batch within {ATTACH_TIMEOUT:.0f} s: {counts[:]}")
        time.sleep(0.1)


# --- measuring the service --------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    at: float
    deliveries: int
    decoded: int
    main_cpu: float
    process_cpu: float


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU of process ``pid`` (all threads), or of one of its threads."""
    path = PROC / str(pid) / ("stat" if thread is None else f"task/{thread}/stat")
    return parse_stat(path.read_text())[1]


def decoded_batches(endpoint: str) -> int:
    feeds = query_status(endpoint, STATUS_TIMEOUT)["feeds"]
    return int(sum(feed["batches"] for feed in feeds))


def snapshot(service: ServiceProcess, endpoint: str, counts: SynchronizedArray[int]) -> Snapshot:
    decoded = decoded_batches(endpoint)  # first: its own cost then falls outside a window's end
    return Snapshot(
        time.monotonic(),
        sum(counts[:]),
        decoded,
        cpu_seconds(service.pid, service.pid),
        cpu_seconds(service.pid),
    )


def rss_mib(pid: int) -> float:
    return parse_status_kib((PROC / str(pid) / "status").read_text(), "VmRSS") / 1024


# --- one run ------------------------------------------------------------------------------------------


def write_list(path: Path, samples: int) -> Path:
    """A ``.csv`` list of ``samples`` files that do not exist: the list source never opens them."""
    with open(path, "w") as out:
        out.write("path,label\n")
        out.writelines(f"img/{i:08d}.jpg,{i % 1000}\n" for i in range(samples))
    return path


@contextlib.contextmanager
def write_nothing_workers() -> Iterator[None]:
    """The benchmark-only hook, in this process's environment for the service it starts."""
    before = os.environ.get(BENCH_WRITE_NOTHING_ENV)
    os.environ[BENCH_WRITE_NOTHING_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[BENCH_WRITE_NOTHING_ENV]
        else:
            os.environ[BENCH_WRITE_NOTHING_ENV] = before


def run_once(spec: RunSpec, data: Path, work: Path) -> RunResult:
    endpoint = f"ipc://{work}/loop-cost.sock"
    service_spec = ServiceSpec(
        data,
        endpoint,
        spec.workers,
        spec.batch_size,
        spec.image_size,
        extra_args=("--slots", str(spec.slots), "--client-timeout", "60"),
    )
    with (
        write_nothing_workers(),
        running_service(service_spec, work / f"service-{spec.samples}-{spec.mode}.log") as service,
        trainers(endpoint, spec) as (counts, errors),
    ):
        _await_first_batches(counts, errors, service)
        time.sleep(spec.warmup)  # a fixed warm-up, not a synchronisation: every trainer is attached
        first = snapshot(service, endpoint, counts)
        time.sleep(spec.seconds)
        last = snapshot(service, endpoint, counts)
        _check_trainers(errors)
        rss = rss_mib(service.pid)
    return RunResult(
        spec.samples,
        spec.mode,
        spec.trainers,
        round(last.at - first.at, 3),
        last.deliveries - first.deliveries,
        last.decoded - first.decoded,
        round(last.main_cpu - first.main_cpu, 3),
        round(last.process_cpu - first.process_cpu, 3),
        round(rss, 1),
    )


# --- report -------------------------------------------------------------------------------------------

COLUMNS = (
    ("N", "samples", "{}"),
    ("mode", "mode", "{}"),
    ("T", "trainers", "{}"),
    ("s", "seconds", "{:.1f}"),
    ("delivered/s", "delivered_per_second", "{:.0f}"),
    ("decoded/s", "decoded_per_second", "{:.0f}"),
    ("main CPU", "main_core_share", "{:.0%}"),
    ("proc CPU", "process_core_share", "{:.0%}"),
    ("us/batch", "us_main_cpu_per_batch", "{:.0f}"),
    ("us/delivery", "us_main_cpu_per_delivery", "{:.0f}"),
    ("1-core batches/s", "sustainable_batches_per_second", "{:.0f}"),
    ("RSS MiB", "rss_mib", "{:.0f}"),
)
"""Title, key of ``RunResult.row`` (or of the rates ``table`` adds), format."""


def table(results: Sequence[RunResult]) -> str:
    """One row per run; CPU columns are shares of one core, us columns main-thread CPU."""
    rows = [[title for title, _, _ in COLUMNS]]
    for r in results:
        values = {
            **r.row(),
            "delivered_per_second": r.deliveries / r.seconds,
            "decoded_per_second": r.decoded / r.seconds,
            "process_core_share": r.process_cpu / r.seconds,
        }
        rows.append([fmt.format(values[key]) for _, key, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def verdicts(results: Sequence[RunResult], batch_size: int) -> list[str]:
    """The issue's target, judged on each run of 8 or more trainers at batch 64, on decoded batches.

    In shard mode every decoded batch is one delivery. In broadcast mode each goes to every member,
    so the line also gives the deliveries one core could sustain; the verdict stays on decoded
    batches, the stricter reading.
    """
    lines = []
    for r in results:
        if r.trainers < 8 or batch_size != 64:
            continue
        ok = "PASS" if r.sustainable >= TARGET_BATCHES_PER_SECOND else "FAIL"
        also = f" ({1e6 / r.us_per_delivery:.0f} deliveries/s)" if r.mode == "broadcast" else ""
        lines.append(
            f"{ok}  one core sustains >= {TARGET_BATCHES_PER_SECOND:.0f} batches/s of 64 at {r.trainers} "
            f"trainers ({r.mode}, N={r.samples}): {r.sustainable:.0f}{also}"
        )
    return lines


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_cost", description=__doc__.split("\n")[0])
    p.add_argument("--samples", default=f"10000,{IMAGENET_SAMPLES}", help="list sizes, comma-separated")
    p.add_argument("--modes", default="shard,broadcast", help="shard and/or broadcast, comma-separated")
    p.add_argument("--trainers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds after every trainer's first batch")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32, help="slot geometry; no pixel is written")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--json", type=Path, help="also save the results here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[RunResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="loop-cost-") as tmp:
        work = Path(tmp)
        for samples in (int(s) for s in args.samples.split(",")):
            data = write_list(work / f"list-{samples}.csv", samples)
            for mode in args.modes.split(","):
                spec = RunSpec(
                    samples,
                    mode,
                    args.trainers,
                    args.seconds,
                    args.warmup,
                    args.workers,
                    args.batch_size,
                    args.image_size,
                    args.slots,
                )
                print(f"N={samples} {mode}: {args.trainers} trainers, {args.seconds:g} s ...", flush=True)
                results.append(run_once(spec, data, work))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print()
    print(table(results))
    for line in verdicts(results, args.batch_size):
        print(line)
    if args.json is not None:
        doc = {"batch_size": args.batch_size, "workers": args.workers, "runs": [r.row() for r in results]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
