"""Micro-benchmark of the wire codec against an earlier revision, plus a wire-compatibility check.

    python -m benchmarks.protocol_speed                  # against HEAD's protocol/messages.py
    python -m benchmarks.protocol_speed --against REV    # any revision whose codec is one module

The baseline is ``git show REV:protocol/messages.py`` imported as a separate module, so both codecs
run in the same process, interleaved round by round (a busy neighbour slows both alike). For each
message the table shows the best time per call of encode, decode, and encode+decode, in microseconds.
Before timing, every sample must encode to the same bytes in both codecs and each codec must decode
the other's frame to the same fields; otherwise the exit code is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import protocol.messages

ROOT = Path(__file__).resolve().parents[1]

# The hot messages first (one or two per batch), then the once-per-session ones for comparison.
SAMPLES: dict[str, Callable[[ModuleType], Any]] = {
    "Task": lambda m: m.Task(4711, 0, 12, 3, bytes(range(256)) * 2),
    "TaskDone": lambda m: m.TaskDone(4711, 1, 64, ((17, "truncated JPEG"),)),
    "BatchReady": lambda m: m.BatchReady(1, 3, 412, 90210, 12, 64),
    "Release": lambda m: m.Release((90207, 90208, 90209, 90210)),
    "Heartbeat": lambda m: m.Heartbeat("3f9a0c1e5b7d"),
    "Hello": lambda m: m.Hello("host:4242", 4242, "train", 6, rank=1, world_size=2),
    "Welcome": lambda m: m.Welcome(
        "3f9a0c1e5b7d",
        m.FeedInfo(
            "train", 2560, 8, 64, 224, 40, 0, "train", "ab" * 16, "dataferry-1-train-00", 12, **_fields(m)
        ),
        1.0,
        20,
        1280,
    ),
}


def _fields(m: ModuleType) -> dict[str, Any]:
    # Protocol 3 added the batch's fields; a baseline from before it has none to give.
    has = "fields" in m.FeedInfo.__dataclass_fields__
    return {"fields": (("image", "uint8", (3, 224, 224)), ("label", "int64", ()))} if has else {}


def load_baseline(rev: str) -> ModuleType:
    """``protocol/messages.py`` as of ``rev``, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{rev}:protocol/messages.py"], cwd=ROOT, capture_output=True, check=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory(prefix="protocol-baseline-") as tmp:
        path = Path(tmp) / "protocol_baseline.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("protocol_baseline", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolves string annotations through sys.modules
        spec.loader.exec_module(module)
    return module


def kinds(module: ModuleType) -> tuple[type, ...]:
    return tuple(getattr(module, name) for name in SAMPLES)


def compatibility_problems(old: ModuleType, new: ModuleType) -> list[str]:
    """Every sample where the two codecs disagree on bytes, or cannot read each other's frames."""
    problems = []
    for name, make in SAMPLES.items():
        old_frame, new_frame = old.encode(make(old)), new.encode(make(new))
        if old_frame != new_frame:
            problems.append(f"{name}: frames differ:\n  old {old_frame.hex()}\n  new {new_frame.hex()}")
        old_reads = dataclasses.astuple(old.decode(new_frame, kinds(old)))
        new_reads = dataclasses.astuple(new.decode(old_frame, kinds(new)))
        if old_reads != new_reads:
            problems.append(f"{name}: decoded fields differ: old {old_reads} new {new_reads}")
    return problems


def best_microseconds(call: Callable[[], object], number: int) -> float:
    return timeit.timeit(call, number=number) / number * 1e6


def time_codec(module: ModuleType, name: str, number: int) -> tuple[float, float, float]:
    """Encode, decode, and encode+decode of one sample, in microseconds per call."""
    msg, expect = SAMPLES[name](module), kinds(module)
    frame = module.encode(msg)
    return (
        best_microseconds(lambda: module.encode(msg), number),
        best_microseconds(lambda: module.decode(frame, expect), number),
        best_microseconds(lambda: module.decode(module.encode(msg), expect), number),
    )


def measure(old: ModuleType, new: ModuleType, number: int, repeat: int) -> dict[str, list[list[float]]]:
    """Per sample: the best of ``repeat`` interleaved rounds for [old, new] x (encode, decode, both)."""
    best: dict[str, list[list[float]]] = {}
    for name in SAMPLES:
        rows = [[float("inf")] * 3, [float("inf")] * 3]
        for _ in range(repeat):
            for row, module in zip(rows, (old, new), strict=True):
                row[:] = map(min, row, time_codec(module, name, number))
        best[name] = rows
    return best


def table(best: dict[str, list[list[float]]]) -> str:
    columns = ("encode old/new", "decode old/new", "both old/new")
    header = f"{'message':<11} " + " ".join(f"{c:>15}" for c in columns) + f" {'new/old':>8}"
    lines = [header, "-" * len(header)]
    for name, (old, new) in best.items():
        cells = " ".join(f"{o:>7.2f}/{n:<7.2f}" for o, n in zip(old, new, strict=True))
        lines.append(f"{name:<11} {cells} {new[2] / old[2]:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="git revision of the baseline codec")
    parser.add_argument("--number", type=int, default=20000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds; the best is shown")
    args = parser.parse_args(argv)
    old, new = load_baseline(args.against), protocol.messages
    problems = compatibility_problems(old, new)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"wire: identical bytes and mutual decoding for {len(SAMPLES)} messages")
    print(f"microseconds per call, best of {args.repeat} x {args.number} (old = {args.against})")
    print(table(measure(old, new, args.number, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
