"""Where a cold first batch's time goes (issue 36): 64 images at 224, train, from an idle service
with 2 workers, each time an epoch nothing decoded ahead.

    python -m benchmarks.cold [--attaches N] [--out DIR]

For each attach it times, on the trainer's side, opening the session (``iter``: hello, welcome, the
pool mapped) and then the first ``next()``; and, in this process afterwards, the decode of that
batch's very samples with the service's own per-sample work (``load_into`` with its recipe, one
process, page cache warm). The service splits a batch that a trainer waits for between its idle
workers (NOTE [ Split batches ]), so the decode's share of the wait is about the slower half: the
per-image times of the batch, in the order of its rows, summed by the part each worker took.
The rest of ``next()`` is the service's and the wire's: planning, two task messages, the workers'
``done``, the announcement, the trainer's mapping of the slot. Medians over the attaches; every
attach's figures in ``cold.json``.
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

BATCH = 64
SIZE = 224
WORKERS = 2


def decode_seconds(data: Path, epoch: int, indices: list[int]) -> list[float]:
    """Each sample's time through the service's per-sample work, in the order of the batch's rows."""
    from loader_service.dataset.index import build_index
    from loader_service.decode.geometry import prepare
    from loader_service.decode.regions import roi_decoder_version
    from loader_service.decode.transforms import Recipe, load_into

    index = build_index(data)
    recipe = Recipe("train", roi=roi_decoder_version() is not None)
    prepare(recipe.interpolation)
    out = np.empty((3, SIZE, SIZE), np.uint8)
    times = []
    for idx in indices:
        start = time.perf_counter()
        load_into(str(index.path(idx)), out, recipe, _sample_rng(0, epoch, idx))
        times.append(time.perf_counter() - start)
    return times


def attach(endpoint: str, data: Path, epoch: int) -> dict[str, float]:
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoint, timeout=60) as loader:
        loader.set_epoch(epoch)
        start = time.perf_counter()
        it = iter(loader)
        opened = time.perf_counter()
        batch = next(it)
        first = time.perf_counter()
        indices = batch.indices.tolist()
        del batch
    per_image = decode_seconds(data, epoch, indices)
    half = -(-len(per_image) // WORKERS)
    parts = [sum(per_image[i : i + half]) for i in range(0, len(per_image), half)]
    return {
        "session_s": opened - start,
        "first_next_s": first - opened,
        "total_s": first - start,
        "decode_sum_s": sum(per_image),
        "decode_slower_part_s": max(parts),
        "rest_s": (first - opened) - max(parts),
    }


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
        wait_booted(endpoint)
        runs = []
        for epoch in range(3, 3 + args.attaches):
            time.sleep(1.0)  # idle: whatever the last attach started has finished
            runs.append(attach(endpoint, data, epoch))
            say(" ".join(f"{k} {v * 1000:.1f} ms" for k, v in runs[-1].items()))
    medians: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    say(
        f"cold first batch (median of {len(runs)}): {medians['total_s'] * 1000:.1f} ms = session "
        f"{medians['session_s'] * 1000:.1f} + first next() {medians['first_next_s'] * 1000:.1f}, of "
        f"which decode (slower of {WORKERS} parts) {medians['decode_slower_part_s'] * 1000:.1f} and the "
        f"rest {medians['rest_s'] * 1000:.1f}; the batch's decode in one process "
        f"{medians['decode_sum_s'] * 1000:.1f}"
    )
    write_results(args.out, "cold", {"median": medians, "attaches": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
