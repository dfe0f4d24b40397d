"""Scenario (m): one trainer fed by a fleet of services on this machine (NOTE [ A fleet ]).

    python -m benchmarks.fleet [--out DIR] [--quick]

Every service runs one decode worker. Four measurements, each a ratio taken in the same run:

* waiting-bound scaling: a pipeline whose per-sample cost is a sleep (standing for slow storage or a
  far-away core, ``BENCH_SAMPLE_SECONDS``), one trainer's images/s with 1, 2, 3, 4 services,
  against K times one service's;
* CPU-bound: the built-in train transform, K services of 1 worker against 1 service of K workers
  (K = the machine's cores): the fleet's own overhead;
* a straggler: 3 services, one 5x slower than the others, against the same 3 at one speed, and
  against the 2 fast ones alone;
* recovery: the longest wait of the loop after one of 3 services is killed (SIGKILL) mid-epoch.

The results go to ``fleet.json`` in ``--out`` and are printed one line each.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.module_output import say, write_results

SAMPLE_SECONDS_ENV = "BENCH_SAMPLE_SECONDS"
BATCH = 8
REPO = Path(__file__).resolve().parent.parent


def sleepy(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """The waiting-bound pipeline: sleeps, never decodes, returns a small image and the label."""
    time.sleep(float(os.environ.get(SAMPLE_SECONDS_ENV, "0.02")))
    return {"image": np.zeros((3, 16, 16), dtype=np.uint8), "label": np.int64(sample["label"])}


@dataclass(frozen=True)
class Plan:
    images: int
    epochs: int
    sample_seconds: float
    image_size: int


@contextmanager
def services(
    data: Path, run_dir: Path, count: int, *, workers: int = 1, pipeline: bool, image_size: int = 0,
    sample_seconds: list[float] | None = None,
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:  # fmt: skip
    """``count`` services on ipc endpoints, the same data and seed; killed on the way out."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for i in range(count):
            endpoint = f"ipc://{run_dir}/s{len(os.listdir(run_dir))}-{i}.sock"
            args = ["serve", "--data", str(data), "--endpoint", endpoint, "--workers", str(workers)]
            args += ["--batch-size", str(BATCH), "--log-level", "WARNING"]
            args += (
                ["--pipeline", "benchmarks.fleet:sleepy"] if pipeline else ["--image-size", str(image_size)]
            )
            env = dict(os.environ)
            if sample_seconds is not None:
                env[SAMPLE_SECONDS_ENV] = str(sample_seconds[i])
            proc = subprocess.Popen([sys.executable, "-m", "loader_service", *args], cwd=REPO, env=env)
            started.append((endpoint, proc))
        yield started
    finally:
        for _, proc in started:
            proc.send_signal(signal.SIGTERM)
        for _, proc in started:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rate(endpoints: list[str], epochs: int) -> float:
    """Images/s of one trainer over ``epochs`` epochs, after one epoch that warms everything up."""
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoints, connect_timeout=120, timeout=120) as loader:
        for _ in loader:
            pass
        images = 0
        start = time.perf_counter()
        for _ in range(epochs):
            for batch in loader:
                images += len(batch.indices)
        return images / (time.perf_counter() - start)


def scaling(data: Path, run_dir: Path, plan: Plan) -> dict[str, float]:
    out: dict[str, float] = {}
    seconds = [plan.sample_seconds] * 4
    for k in (1, 2, 3, 4):
        with services(data, run_dir, k, pipeline=True, sample_seconds=seconds) as fleet:
            out[f"services_{k}"] = rate([e for e, _ in fleet], plan.epochs)
        say(f"(m) waiting-bound, {k} services: {out[f'services_{k}']:.1f} images/s")
    for k in (2, 3, 4):
        out[f"ratio_{k}_over_k_times_one"] = out[f"services_{k}"] / (k * out["services_1"])
    return out


def cpu_bound(data: Path, run_dir: Path, plan: Plan) -> dict[str, float]:
    cores = os.cpu_count() or 2
    out: dict[str, float] = {}
    for round_ in range(2):  # alternated, so a slow minute of the machine hits both
        with services(data, run_dir, cores, pipeline=False, image_size=plan.image_size) as fleet:
            out[f"fleet_{round_}"] = rate([e for e, _ in fleet], plan.epochs)
        with services(data, run_dir, 1, workers=cores, pipeline=False, image_size=plan.image_size) as one:
            out[f"one_{round_}"] = rate([e for e, _ in one], plan.epochs)
    fleet_rate = sum(out[f"fleet_{r}"] for r in range(2)) / 2
    one_rate = sum(out[f"one_{r}"] for r in range(2)) / 2
    say(
        f"(m) CPU-bound: {cores} services x 1 worker {fleet_rate:.1f} images/s, "
        f"1 x {cores} workers {one_rate:.1f}"
    )
    return {
        "cores": float(cores),
        "fleet": fleet_rate,
        "one_service": one_rate,
        "ratio": fleet_rate / one_rate,
    }


def straggler(data: Path, run_dir: Path, plan: Plan) -> dict[str, float]:
    fast = plan.sample_seconds
    out: dict[str, float] = {}
    with services(data, run_dir, 3, pipeline=True, sample_seconds=[fast, fast, 5 * fast]) as fleet:
        out["with_straggler"] = rate([e for e, _ in fleet], plan.epochs)
    with services(data, run_dir, 3, pipeline=True, sample_seconds=[fast] * 3) as fleet:
        out["three_even"] = rate([e for e, _ in fleet], plan.epochs)
    with services(data, run_dir, 2, pipeline=True, sample_seconds=[fast] * 2) as fleet:
        out["two_fast"] = rate([e for e, _ in fleet], plan.epochs)
    out["ratio_to_three_even"] = out["with_straggler"] / out["three_even"]
    out["ratio_to_two_fast"] = out["with_straggler"] / out["two_fast"]
    say(
        f"(m) straggler: {out['with_straggler']:.1f} images/s; {out['ratio_to_three_even']:.2f}x three "
        f"even services, {out['ratio_to_two_fast']:.2f}x the two fast ones alone"
    )
    return out


def recovery(data: Path, run_dir: Path, plan: Plan) -> dict[str, float]:
    """The loop's longest wait for a batch after one of three services is SIGKILLed mid-epoch."""
    from gpu_worker import ServiceLoader

    seconds = [plan.sample_seconds] * 3
    with (
        services(data, run_dir, 3, pipeline=True, sample_seconds=seconds) as fleet,
        ServiceLoader([e for e, _ in fleet], connect_timeout=120, timeout=120) as loader,
    ):
        for _ in loader:
            pass
        gaps: list[float] = []
        last = time.perf_counter()
        for i, _batch in enumerate(loader):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if i == 4:
                fleet[1][1].send_signal(signal.SIGKILL)
        before = sorted(gaps[1:5])
        after = gaps[5:]
        reassigned = float(loader.stats()["reassigned"])
    worst = max(after)
    typical = before[len(before) // 2]
    say(f"(m) SIGKILL of 1 of 3 services: longest wait after it {worst:.2f} s (typical {typical:.3f} s)")
    return {
        "longest_wait_s": worst,
        "typical_wait_s": typical,
        "reassigned": reassigned,
    }


PARTS = {"scaling": scaling, "cpu_bound": cpu_bound, "straggler": straggler, "recovery": recovery}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="where fleet.json goes (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="a small dataset and one timed epoch")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)"
    )
    parser.add_argument("--images", type=int, default=0, help="photos to generate (default 256; quick 96)")
    parser.add_argument("--epochs", type=int, default=0, help="timed epochs after the warm-up (default 2)")
    args = parser.parse_args(argv)
    plan = (
        Plan(images=96, epochs=1, sample_seconds=0.02, image_size=96)
        if args.quick
        else Plan(images=256, epochs=2, sample_seconds=0.02, image_size=160)
    )
    if args.images < 0 or args.epochs < 0:
        parser.error("--images and --epochs must be positive")
    plan = replace(plan, images=args.images or plan.images, epochs=args.epochs or plan.epochs)
    from loader_service.tools.sample_data import make_sample_dataset

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-fleet-")))
        data = work / "data"
        make_sample_dataset(data, classes=4, per_class=plan.images // 4, seed=3)
        run_dir = work / "run"
        run_dir.mkdir()
        results: dict[str, Any] = {"plan": plan.__dict__}
        for part in args.parts.split(","):
            if part not in PARTS:
                parser.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
            results[part] = PARTS[part](data, run_dir, plan)
    write_results(args.out, "fleet", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
