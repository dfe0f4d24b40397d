"""``--workers auto`` against fixed worker counts, on this machine, in the same run (issue 28).

    python -m benchmarks.sizing [--quick] [--out DIR]

Each part starts one service per worker setting (auto, then each fixed count) on the same data and
seed and reads it with one trainer:

* waiting: a pipeline whose per-sample cost is a 10 ms sleep (slow storage, a second read): the
  first epoch's images/s (the controller's ramp included) and the later epochs';
* computing: the built-in train transform, with a trainer whose own step keeps one core busy;
* trainer-bound: the built-in train transform, with a trainer whose step (a sleep) lets it take
  half of what the best setting of the computing part gave: images/s and the workers still
  taking tasks at the end;
* convergence (from the waiting part's auto run): seconds from the first batch until one second's
  rate first reaches 95 % of the later epochs' rate;
* attach (issue 36): a trainer attaches to an idle service whose pipeline waits 10 ms a sample,
  batches of 16; status is polled ten times a second, so auto's run also says when the first
  workers came (seconds after the attach) and when it first reached its final count, beside its
  first epoch against the best fixed count's and the time to 95 %.

The trainer attaches once every worker the service started is ready, as it does to a service that
runs for days: its first epoch includes the controller's ramp, not the workers' boot.

Each figure is reported against the best fixed count of the same part as a ratio; nothing here is
compared across runs. Results go to ``sizing.json`` in ``--out`` and are printed a line each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.fleet import SAMPLE_SECONDS_ENV
from benchmarks.module_output import say, write_results
from benchmarks.service_process import serving

BATCH = 8
ATTACH_BATCH = 16
WAIT_SECONDS = 0.01


@dataclass(frozen=True)
class Plan:
    images: int
    epochs: int
    """Epochs timed after the first (whose figure includes the ramp)."""
    fixed: tuple[int, ...]


@dataclass
class Run:
    first_epoch: float
    """Images/s of the first epoch, from the first ``next()``."""
    later: float
    """Images/s of the epochs after it."""
    converged_s: float
    """Seconds from the first batch until a one-second rate first reached 95 % of ``later``."""
    active: int
    """Workers taking tasks at the end (the status' figure)."""
    first_add_s: float = float("nan")
    """Seconds from the attach until status first showed more workers than at the attach."""
    final_count_s: float = float("nan")
    """Seconds from the attach until status first showed the count it ended with."""


@contextmanager
def service(data: Path, run_dir: Path, workers: str, extra: list[str], env: dict[str, str]) -> Iterator[str]:
    """One service on an ipc endpoint; stopped on the way out."""
    args = ["--data", str(data), "--workers", workers]
    args += ["--batch-size", str(BATCH), "--heartbeat-interval", "0.5", "--log-level", "WARNING", *extra]
    with serving(run_dir, args, env) as (endpoint, _pid):
        yield endpoint


def burn(seconds: float) -> None:
    """A trainer step that keeps one core busy for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def read(endpoint: str, plan: Plan, step: float, busy_step: bool, watch: bool = False) -> Run:
    from gpu_worker import ServiceLoader
    from loader_service.tools.status_view import query_status

    stamps: list[tuple[float, int]] = []
    counts: list[tuple[float, int]] = []
    wait_booted(endpoint)
    with ExitStack() as stack:
        if watch:
            stack.enter_context(watching(endpoint, counts))
        loader = stack.enter_context(ServiceLoader(endpoint, connect_timeout=120, timeout=120))
        start = time.perf_counter()
        ends = []
        for _ in range(1 + plan.epochs):
            for batch in loader:
                stamps.append((time.perf_counter(), len(batch.indices)))
                del batch
                if step:
                    burn(step) if busy_step else time.sleep(step)
            ends.append(time.perf_counter())
        active = int(query_status(endpoint, 10)["sizing"]["active"])
    per_epoch = sum(n for _, n in stamps) / (1 + plan.epochs)
    first = per_epoch / (ends[0] - start)
    later = per_epoch * plan.epochs / (ends[-1] - ends[0])
    run = Run(first, later, _converged(stamps, start, later), active)
    if counts:
        run.first_add_s = next((t - start for t, n in counts if n > counts[0][1]), float("nan"))
        run.final_count_s = next((t - start for t, n in counts if t >= start and n == active), float("nan"))
    return run


@contextmanager
def watching(endpoint: str, counts: list[tuple[float, int]]) -> Iterator[None]:
    """Poll the workers taking tasks ten times a second into ``counts`` (when, how many)."""
    from loader_service.tools.status_view import query_status

    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, RuntimeError):
                counts.append((time.perf_counter(), int(query_status(endpoint, 5)["sizing"]["active"])))
            stop.wait(0.1)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def wait_booted(endpoint: str, timeout: float = 120.0) -> None:
    """Until every worker the service started (parked ones too) is ready and nothing is decoding:
    a service runs long before its trainers, so their first epoch should not pay its boot."""
    from loader_service.tools.status_view import query_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = query_status(endpoint, 5)
        except (TimeoutError, RuntimeError):
            time.sleep(0.2)  # not listening yet
            continue
        workers = body.get("worker_list") or []
        if workers and all(w["ready"] and w["task"] is None for w in workers):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the service at {endpoint} did not finish starting within {timeout:.0f} s")


def _converged(stamps: list[tuple[float, int]], start: float, target: float) -> float:
    """Seconds from ``start`` until the images of one second reach 95 % of ``target``."""
    for i, (t, _) in enumerate(stamps):
        window = [n for s, n in stamps[i:] if s - t <= 1.0]
        if stamps[-1][0] - t >= 1.0 and sum(window) >= 0.95 * target:
            return t - start
    return float("nan")


def part(
    name: str, data: Path, run_dir: Path, plan: Plan, extra: list[str], env: dict[str, str], step: float,
    busy_step: bool = False, watch: bool = False,
) -> dict[str, Any]:  # fmt: skip
    runs: dict[str, Run] = {}
    for workers in ("auto", *map(str, plan.fixed)):
        with service(data, run_dir, workers, extra, env) as endpoint:
            runs[workers] = read(endpoint, plan, step, busy_step, watch and workers == "auto")
        r = runs[workers]
        say(
            f"{name}, --workers {workers}: first epoch {r.first_epoch:.0f} images/s, later "
            f"{r.later:.0f}, {r.active} workers taking tasks at the end"
        )
    best_fixed = max((w for w in runs if w != "auto"), key=lambda w: runs[w].later)
    best_first = max(runs[w].first_epoch for w in runs if w != "auto")
    auto = runs["auto"]
    out = {
        "runs": {w: r.__dict__ for w, r in runs.items()},
        "best_fixed": int(best_fixed),
        "auto_over_best_later": auto.later / runs[best_fixed].later,
        "auto_over_best_first_epoch": auto.first_epoch / best_first,
        "auto_converged_s": auto.converged_s,
    }
    say(
        f"{name}: auto / best fixed ({best_fixed}) {out['auto_over_best_later']:.2f}x later, "
        f"{out['auto_over_best_first_epoch']:.2f}x in the first epoch; auto at 95 % after "
        f"{auto.converged_s:.1f} s, {auto.active} workers at the end"
    )
    if watch:
        out["auto_first_add_s"], out["auto_final_count_s"] = auto.first_add_s, auto.final_count_s
        say(
            f"{name}: auto's first workers {auto.first_add_s:.2f} s after the attach, its final "
            f"count ({auto.active}) after {auto.final_count_s:.2f} s"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sizing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="where sizing.json goes (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="fewer images and epochs")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    fixed = tuple(sorted({1, cores, 2 * cores, 4 * cores}))
    plan = Plan(240, 1, fixed) if args.quick else Plan(1200, 3, fixed)
    from loader_service.tools.sample_data import make_sample_dataset

    results: dict[str, Any] = {"plan": plan.__dict__, "cores": cores}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-sizing-")))
        data = work / "data"
        make_sample_dataset(data, classes=4, per_class=plan.images // 4, seed=5)
        run_dir = work / "run"
        run_dir.mkdir()
        waiting = ["--pipeline", "benchmarks.fleet:sleepy"]
        env = {SAMPLE_SECONDS_ENV: str(WAIT_SECONDS)}
        results["waiting"] = part("waiting", data, run_dir, plan, waiting, env, 0.0)
        attach = [*waiting, "--batch-size", str(ATTACH_BATCH)]  # the later flag wins
        results["attach"] = part("attach", data, run_dir, plan, attach, env, 0.0, watch=True)
        builtin = ["--image-size", "160"]
        computing_plan = Plan(plan.images, plan.epochs, tuple(sorted({1, cores, cores + 1})))
        results["computing"] = part("computing", data, run_dir, computing_plan, builtin, {}, 0.01, True)
        best = max(r["later"] for r in results["computing"]["runs"].values())
        step = 2 * BATCH / best  # the trainer takes half of what the best setting gave
        results["trainer_bound"] = part("trainer-bound", data, run_dir, computing_plan, builtin, {}, step)
    write_results(args.out, "sizing", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
