"""What ``loader-service top`` watching a service costs it (issue 39: less than 1 % of its images/s).

    python -m benchmarks.top_cost [--pairs 4] [--seconds 8] [--quick] [--out DIR]

One service (``--workers`` the cores here, the built-in train transform at 160 px, batches of 32)
and one trainer process that takes every batch as soon as it can, so the decode workers, not the
trainer, set the rate. Its images/s is measured in alternating segments, A B A B...: A with nothing
watching, B with ``loader-service top`` running on a pseudo-terminal of 160x50 (its live view, a
frame a second, as over ssh or in tmux). Each top is started before its segment and measured only
once its first frame is drawn and a second more has passed (each A waits as long), so its start-up
is not counted: the figure is the cost while it watches. It is quit with q after the segment.

Reported: each pair's B/A ratio, their median and range (the cost is 1 - median), over every pair
and over the quiet ones: each segment notes the CPU the machine's other work used meanwhile (every
process outside this benchmark's tree), and a pair where that reached ``QUIET`` cores is not quiet
(on a shared machine a neighbour's test run moves images/s by 20 % and more). Then the spread of
the A segments among themselves (a cost below it cannot be told from nothing), top's own CPU as a
share of one core, and the median time from a status request to its answer (at most what each
frame costs the service's main loop). Results go to ``top_cost.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import multiprocessing as mp
import os
import pty
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from benchmarks.module_output import say, write_results
from benchmarks.proctree import CLOCK_TICKS, PROC, cpu_seconds, parse_stat, tree
from benchmarks.service_process import BenchError, ServiceSpec, running_service
from benchmarks.stats import median, paired_ratio, rate

BATCH = 32
IMAGE_SIZE = 160
SETTLE = 1.0
"""Seconds between a segment's set-up (top's first frame drawn) and its measurement."""
FIRST_FRAME_TIMEOUT = 30.0
QUIET = 0.1
"""Cores of other work on the machine under which a pair counts as quiet."""
REPO = Path(__file__).resolve().parent.parent


def trainer_main(endpoint: str, images: Synchronized[int], stop: Event) -> None:
    """Take every batch at once, counting its images in ``images``, until ``stop``."""
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoint, timeout=120, connect_timeout=120) as loader:
        while not stop.is_set():
            for batch in loader:
                images.value += len(batch.indices)
                del batch
                if stop.is_set():
                    break


@contextlib.contextmanager
def trainer(endpoint: str) -> Iterator[Synchronized[int]]:
    ctx = mp.get_context("spawn")
    images: Synchronized[int] = ctx.Value("q", 0, lock=False)
    stop = ctx.Event()
    proc = ctx.Process(target=trainer_main, args=(endpoint, images, stop), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while images.value == 0:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise BenchError(f"the trainer took no batch (exit code {proc.exitcode})")
            time.sleep(0.1)
        yield images
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class Top:
    """``loader-service top`` on a pseudo-terminal; what it draws is read (and dropped) as it comes."""

    def __init__(self, endpoint: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        command = [sys.executable, "-m", "loader_service", "top", "--endpoint", endpoint]
        self.proc = subprocess.Popen(
            command, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env, start_new_session=True
        )
        os.close(slave)
        self.drawn = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: top exited and the terminal closed
                return
            if not chunk:
                return
            if b"trainer(s)" in chunk:
                self.drawn.set()

    def cpu_seconds(self) -> float:
        return parse_stat((PROC / str(self.proc.pid) / "stat").read_text())[1]

    def quit(self) -> None:
        """q, as a user would; it must exit 0 within 5 s."""
        try:
            os.write(self.master, b"q")
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise BenchError("top did not quit within 5 s of q") from None
        finally:
            self._reader.join(5)
            os.close(self.master)
        if code != 0:
            raise BenchError(f"top exited with {code}")


@dataclass(frozen=True)
class Segment:
    images_per_s: float
    top_cpu: float
    """Cores top used over the segment (0 unwatched)."""
    others: float
    """Cores the machine's other work used meanwhile: every process's CPU but this benchmark's tree."""


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (``/proc/stat``: all but idle and iowait)."""
    ticks = [int(x) for x in (PROC / "stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS


def segment(endpoint: str, images: Synchronized[int], seconds: float, watched: bool) -> Segment:
    top = Top(endpoint) if watched else None
    try:
        if top is not None and not top.drawn.wait(FIRST_FRAME_TIMEOUT):
            raise BenchError(f"top drew no frame within {FIRST_FRAME_TIMEOUT:.0f} s")
        time.sleep(SETTLE)
        before = (top.cpu_seconds() if top else 0.0, busy_seconds(), cpu_seconds(tree(os.getpid())))
        count, start = images.value, time.monotonic()
        time.sleep(seconds)
        count, elapsed = images.value - count, time.monotonic() - start
        top_cpu = top.cpu_seconds() - before[0] if top else 0.0
        others = busy_seconds() - before[1] - (cpu_seconds(tree(os.getpid())) - before[2])
    finally:
        if top is not None:
            top.quit()
    return Segment(rate(count, elapsed), top_cpu / elapsed, max(0.0, others / elapsed))


def measure(data: Path, run_dir: Path, pairs: int, seconds: float) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    endpoint = f"ipc://{run_dir}/top-cost.sock"
    spec = ServiceSpec(data, endpoint, cores, BATCH, IMAGE_SIZE)
    runs: list[tuple[Segment, Segment]] = []
    with running_service(spec, run_dir / "service.log"), trainer(endpoint) as images:
        segment(endpoint, images, seconds, False)  # warm-up: page cache, the workers' first batches
        answer = status_round_trip(endpoint)
        for i in range(pairs):
            runs.append((segment(endpoint, images, seconds, False), segment(endpoint, images, seconds, True)))
            a, b = runs[-1]
            say(
                f"pair {i + 1}/{pairs}: {a.images_per_s:.0f} images/s alone, {b.images_per_s:.0f} watched "
                f"by top (other work on the machine meanwhile: {a.others:.2f} and {b.others:.2f} cores)"
            )
    return {**summary(runs, cores, seconds), "status_round_trip_s": answer}


def summary(runs: list[tuple[Segment, Segment]], cores: int, seconds: float) -> dict[str, Any]:
    """The ratios of every pair, and of the pairs the machine's other work left alone."""
    quiet = [(a, b) for a, b in runs if max(a.others, b.others) < QUIET]
    alone = [a.images_per_s for a, _ in runs]
    return {
        "cores": cores, "seconds": seconds, "segments": [[asdict(a), asdict(b)] for a, b in runs],
        "all": ratios(runs), "quiet": ratios(quiet) if quiet else None, "quiet_pairs": len(quiet),
        "median_alone": median(alone), "alone_spread": max(alone) / min(alone) - 1 if min(alone) else None,
        "top_cpu_share_of_a_core": sum(b.top_cpu for _, b in runs) / len(runs),
    }  # fmt: skip


def ratios(runs: list[tuple[Segment, Segment]]) -> dict[str, Any]:
    alone, watched = [a.images_per_s for a, _ in runs], [b.images_per_s for _, b in runs]
    each = [b / a for a, b in zip(alone, watched, strict=True) if a > 0]
    return {"median": paired_ratio(watched, alone), "range": [min(each), max(each)], "pairs": len(each)}


def status_round_trip(endpoint: str, times: int = 20) -> float | None:
    """The median seconds from a status request to its answer on one connection, as top asks: at
    most what each frame costs the service's main loop (it includes the client's own decoding)."""
    from loader_service.tools.top_live import StatusLink, snapshot

    link = StatusLink(endpoint, None, None)
    took = []
    try:
        for _ in range(times):
            start = time.perf_counter()
            snapshot(link, 10.0)
            took.append(time.perf_counter() - start)
            time.sleep(0.05)
    finally:
        link.close()
    return median(took)


def report(results: dict[str, Any]) -> None:
    for name in ("all", "quiet"):
        if results[name] is None:
            say(f"{name} pairs: none (other work on the machine used {QUIET} cores or more in every pair)")
            continue
        ratio, (low, high), count = results[name]["median"], results[name]["range"], results[name]["pairs"]
        alone, cores = results["median_alone"], results["cores"]
        say(
            f"{name} pairs ({count}): watched by top / alone, median {ratio:.4f} (pairs {low:.4f}-"
            f"{high:.4f}): cost {100 * (1 - ratio):.2f}% of {alone:.0f} images/s on {cores} cores"
        )
    top_cpu, answer = 100 * results["top_cpu_share_of_a_core"], 1000 * results["status_round_trip_s"]
    say(f"top itself used {top_cpu:.2f}% of a core; a status answer took {answer:.2f} ms (one a second)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.top_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pairs", type=int, default=4, help="A B pairs (default 4)")
    parser.add_argument("--seconds", type=float, default=8.0, help="each segment's length (default 8)")
    parser.add_argument(
        "--quick", action="store_true", help="2 pairs of 3 s: checks the path, not for quoting"
    )
    parser.add_argument("--out", default="", help="where top_cost.json goes (default: a temporary folder)")
    args = parser.parse_args(argv)
    pairs, seconds = (2, 3.0) if args.quick else (args.pairs, args.seconds)
    from loader_service.tools.sample_data import make_sample_dataset

    with tempfile.TemporaryDirectory(prefix="dataferry-top-cost-") as folder:
        work = Path(folder)
        make_sample_dataset(work / "data", classes=4, per_class=64 if args.quick else 256, seed=3)
        (work / "run").mkdir()
        try:
            results = measure(work / "data", work / "run", pairs, seconds)
        except BenchError as exc:
            print(f"benchmarks.top_cost: {exc}", file=sys.stderr)
            return 1
    report(results)
    write_results(args.out, "top_cost", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
