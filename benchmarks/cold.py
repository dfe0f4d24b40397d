"""Where a cold first batch's time goes (issue 36): 64 images at 224, train, from an idle service
with 2 workers, each time an epoch nothing decoded ahead.

    python -m benchmarks.cold [--attaches N] [--out DIR]

For each attach it times, on the trainer's side, the first ``next()`` (the session opens there:
hello, welcome, the pool mapped, the epoch started, the batch decoded and announced); and, in this
process afterwards, once the service is idle again, the decode of that batch's very samples with
the service's own per-sample work (``load_into`` with its recipe, one process, page cache warm,
the fastest of ``REPEATS`` for each sample). The service splits a batch that a trainer waits for
between its idle workers (NOTE [ Split batches ]), so the decode's share of the wait is the slower
part (``plan_parts``, the service's own split). The rest of ``next()`` is the service's and the
wire's: the session, planning, the task messages, the workers' ``done``, the announcement, the
mapping of the slot. After each, an attach to epoch 0, whose first batches the service keeps
decoded (NOTE [ Warm start ]), times the session and the delivery without any decode: what is left
of the rest is the dispatch to the workers and back. Medians over the attaches; every attach's
figures in ``cold.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from benchmarks.contenders import _sample_rng
from benchmarks.module_output import say, write_results
from benchmarks.service_process import serving
from benchmarks.sizing import wait_booted
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.decoders import roi_decoder_version
from loader_service.decode.transforms import Recipe
from protocol.pixels.geometry import prepare

BATCH = 64
SIZE = 224
WORKERS = 2
REPEATS = 3
IDLE = 1.0
"""Seconds to let the service finish what the last attach started, before timing anything."""


def decode_seconds(index: DatasetIndex, recipe: Recipe, epoch: int, indices: list[int]) -> list[float]:
    """Each sample's time through the service's per-sample work, in the order of the batch's rows."""
    from loader_service.decode.transforms import load_into

    out = np.empty((3, SIZE, SIZE), np.uint8)
    times = []
    for idx in indices:
        path = str(index.path(idx))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            load_into(path, out, recipe, _sample_rng(0, epoch, idx))
            best = min(best, time.perf_counter() - start)
        times.append(best)
    return times


def first_batch(endpoint: str, epoch: int) -> tuple[float, list[int]]:
    """Seconds to the first batch of ``epoch`` from a new loader, and that batch's samples."""
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoint, timeout=60) as loader:
        loader.set_epoch(epoch)
        start = time.perf_counter()
        indices = next(iter(loader)).indices.tolist()
        return time.perf_counter() - start, indices


def attach(endpoint: str, index: DatasetIndex, recipe: Recipe, epoch: int) -> dict[str, float]:
    from loader_service.supervisor.workers.parts import plan_parts

    first, indices = first_batch(endpoint, epoch)
    time.sleep(IDLE)  # the service decoded ahead for that trainer meanwhile: not while timing here
    warm, _ = first_batch(endpoint, 0)
    time.sleep(IDLE)
    per_image = decode_seconds(index, recipe, epoch, indices)
    parts = [sum(per_image[at : at + rows]) for at, rows in plan_parts(len(indices), WORKERS)]
    return {
        "first_next_s": first,
        "decode_sum_s": sum(per_image),
        "decode_slower_part_s": max(parts),
        "rest_s": first - max(parts),
        "warm_first_next_s": warm,
        "dispatch_s": first - max(parts) - warm,
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold", description=__doc__.split("\n\n")[0])
    parser.add_argument("--attaches", type=int, default=9, help="attaches timed (default 9)")
    parser.add_argument("--out", default="", help="where cold.json goes (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.attaches < 1:
        parser.error("--attaches must be at least 1")
    cv2.setNumThreads(1)
    from loader_service.tools.sample_data import make_sample_dataset

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-cold-")))
        data = work / "data"
        make_sample_dataset(data, classes=4, per_class=64, seed=11)
        run_dir = work / "run"
        run_dir.mkdir()
        flags = ["--data", str(data), "--workers", str(WORKERS), "--batch-size", str(BATCH)]
        flags += ["--image-size", str(SIZE), "--augment", "train", "--log-level", "WARNING"]
        endpoint, _pid = stack.enter_context(serving(run_dir, flags))
        index = build_index(data)  # this process's own, for timing the samples' decode
        recipe = Recipe("train", roi=roi_decoder_version() is not None)  # the service's (--decoder auto)
        prepare(recipe.interpolation)
        wait_booted(endpoint)
        runs = []
        for epoch in range(3, 3 + args.attaches):
            time.sleep(IDLE)
            runs.append(attach(endpoint, index, recipe, epoch))
            say(" ".join(f"{k} {ms(v)} ms" for k, v in runs[-1].items()))
    medians: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    say(
        f"cold first batch (median of {len(runs)}): {ms(medians['first_next_s'])} ms, of which decode "
        f"(the slower of {WORKERS} parts) {ms(medians['decode_slower_part_s'])} and the rest "
        f"{ms(medians['rest_s'])}: a warm first batch (session and delivery) "
        f"{ms(medians['warm_first_next_s'])}, dispatch {ms(medians['dispatch_s'])}; the batch's decode in "
        f"one process {ms(medians['decode_sum_s'])}"
    )
    write_results(args.out, "cold", {"median": medians, "attaches": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
