"""Who decodes: the service alone, the trainer every row it can, or a share found while the loop runs
(issue 46), in the same run, on the same service and photos.

    python -m benchmarks.split [--workers 1] [--step 0] [--rounds 3] [--quick] [--out DIR]

One service (``--workers`` decode processes, train at 224, batches of 32) and one trainer on this
machine whose loop takes ``--step`` seconds a batch (0: it only pulls) and decodes in one thread of
its own where asked. Each round reads an epoch after two to settle with ``decode="service"``,
``"trainer"`` and ``"auto"`` in turn (A B C, then the next round), each a new loader. Reported: each
mode's images/s (the median of the rounds), and ``auto`` against the better fixed extreme, which
NOTE [ Finding the split ] in gpu_worker/split.py says should cost the loop at most 5 %; the share
``auto`` ended at and its moves. Results go to ``split.json`` in ``--out``.
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

from benchmarks.config import BenchConfig
from benchmarks.datasets import prepare_data
from benchmarks.module_output import say, write_results
from benchmarks.service_process import serving
from benchmarks.sizing import wait_booted

MODES = ("service", "trainer", "auto")
SETTLE_EPOCHS = 4
"""Epochs each loader reads before the one measured: ``auto`` settles within about four seconds."""


def epoch_rate(loader: Any, step: float) -> float:
    """Images a second over one epoch, the loop sleeping ``step`` seconds a batch."""
    images, start = 0, time.perf_counter()
    for batch in loader:
        images += len(batch.indices)
        if step:
            time.sleep(step)
    return images / (time.perf_counter() - start)


def measure(endpoint: str, mode: str, step: float, number: int) -> tuple[float, dict[str, Any]]:
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoint, decode=mode, decode_threads=1, timeout=120) as loader:
        for settle in range(SETTLE_EPOCHS):
            loader.set_epoch(number + settle)
            epoch_rate(loader, step)
        loader.set_epoch(number + SETTLE_EPOCHS)
        rate = epoch_rate(loader, step)
        return rate, loader.stats()["decode"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1, help="the service's decode processes")
    parser.add_argument("--step", type=float, default=0.0, help="seconds the loop spends on a batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="256 photos, one round: checks the path")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    data = Path(prepare_data(BenchConfig(images=256 if args.quick else 512)).root)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    ends: list[dict[str, Any]] = []
    with ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-split-")))
        flags = ["--data", str(data), "--workers", str(args.workers), "--batch-size", "32"]
        flags += ["--image-size", "224", "--augment", "train", "--log-level", "WARNING"]
        endpoint, _ = stack.enter_context(serving(run_dir, flags))
        wait_booted(endpoint, timeout=120)
        number = 0
        for r in range(rounds):
            for mode in MODES:
                rate, decode = measure(endpoint, mode, args.step, number)
                number += SETTLE_EPOCHS + 1
                rates[mode].append(rate)
                if mode == "auto":
                    ends.append(decode)
                say(f"round {r + 1}/{rounds}: {mode}: {rate:.0f} images/s, share {decode['share']:.2f}")
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    best = max(medians["service"], medians["trainer"])
    ratio = medians["auto"] / best
    say(
        f"images/s: service {medians['service']:.0f}, trainer {medians['trainer']:.0f}, auto "
        f"{medians['auto']:.0f}: auto is {ratio:.3f} of the better fixed extreme (shares at the end: "
        f"{', '.join(str(e['share']) for e in ends)})"
    )
    write_results(
        args.out, "split", {"rates": rates, "medians": medians, "auto_of_best": ratio, "auto": ends}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
