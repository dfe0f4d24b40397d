"""What an idle service costs in memory at a given CPU budget (issue 36).

    python -m benchmarks.idle_memory [--budgets 2,16,64,128] [--pipeline SPEC] [--data DIR]

For each budget it starts ``loader-service serve --cpu-budget N`` (no ``--workers``: sized to that
budget, whatever this machine has), waits until the memory of its process tree stops changing, and
prints the USS (pages no other process shares, ``smaps_rollup``) of the main process and of the
workers (the template they are forked from included), the processes counted and the shared memory
of its segments. A pipeline (``--pipeline FILE.py:FUNC``) shows what a pipeline that imports torch
costs. Results go to ``idle_memory.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.probe import tree_of, uss_of
from benchmarks.module_output import say, write_results

SETTLED = 0.02
"""A tree whose USS moved by less than this share over ``STABLE`` samples 1.5 s apart is idle."""
STABLE = 4
TIMEOUT = 300.0


def measure(data: Path, budget: str, pipeline: str) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="dataferry-idle-")
    command = [sys.executable, "-m", "loader_service", "serve", "--data", str(data), "--cpu-budget", budget]
    command += ["--endpoint", f"ipc://{folder}/s.sock", "--batch-size", "256", "--log-level", "WARNING"]
    command += ["--pipeline", pipeline] if pipeline else ["--image-size", "224"]
    proc = subprocess.Popen(command, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        pids = _settled_tree(proc.pid)
        main = uss_of(proc.pid)
        total = sum(uss_of(pid) for pid in pids)
        shm = sum(
            os.stat(f"/dev/shm/{name}").st_blocks * 512
            for name in os.listdir("/dev/shm")
            if name.startswith(f"dataferry-{proc.pid}-")
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    mib = 2**20
    return {
        "budget": float(budget),
        "processes": len(pids),
        "main_mib": round(main / mib, 1),
        "workers_mib": round((total - main) / mib, 1),
        "shm_mib": round(shm / mib, 1),
    }


def _settled_tree(pid: int) -> list[int]:
    """The process tree once its memory has stopped changing (every worker booted and idle)."""
    last, stable, deadline = -1, 0, time.monotonic() + TIMEOUT
    while stable < STABLE and time.monotonic() < deadline:
        time.sleep(1.5)
        now = sum(uss_of(p) for p in tree_of(pid))
        stable = stable + 1 if last > 0 and abs(now - last) < SETTLED * last else 0
        last = now
    return tree_of(pid)


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_memory", description=summary)
    parser.add_argument("--budgets", default="2,16,64,128", help="--cpu-budget values, comma-separated")
    parser.add_argument("--pipeline", default="", help="a --pipeline to serve (default: built-in)")
    parser.add_argument("--data", type=Path, default=None, help="an ImageFolder (default: 64 photos)")
    parser.add_argument("--out", default="", help="where idle_memory.json goes (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dataferry-idle-data-") as scratch:
        data = args.data
        if data is None:
            from loader_service.tools.sample_data import make_sample_dataset

            data = Path(scratch) / "data"
            make_sample_dataset(data, classes=4, per_class=16, seed=3)
        rows = []
        for budget in args.budgets.split(","):
            row = measure(data, budget, args.pipeline)
            rows.append(row)
            say(
                f"--cpu-budget {budget}: {row['processes']} processes, workers {row['workers_mib']:.0f} MiB, "
                f"main {row['main_mib']:.0f} MiB, segments {row['shm_mib']:.0f} MiB"
            )
    write_results(args.out, "idle_memory", {"pipeline": args.pipeline, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
