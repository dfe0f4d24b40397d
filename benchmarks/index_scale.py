"""Index build at scale: a million-sample tar, csv and jsonl source, timed and weighed.

    python -m benchmarks.index_scale                       # 1,000,000 samples, 100 shards, in a temp dir
    python -m benchmarks.index_scale --samples 100000 --dir /mnt/scratch --json index.json

The tar shards are synthetic but real: every member has a valid ustar header where a WebDataset
writer would put it (``KEY.jpg`` of a random 40-200 KB size, then ``KEY.cls``), and the image bytes
between headers are holes of a sparse file, since only headers are read at indexing. That takes about
4 KiB of disk per sample. The csv and jsonl lists name ImageNet-like paths with a label. The sources
are written first, so the page cache is warm: the figures are the indexing work, not a cold disk.

Each source is indexed in a fresh child process (``build_index`` as the service calls it, then the
fingerprint the service computes once), which reports the time, the bytes of the index's arrays
(what the service keeps and every decode worker maps) and the growth of its RSS, retained and peak.
Targets (issue 11): under 30 s and under 100 bytes a sample for a million tar or list samples.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil

TARGET_SECONDS = 30.0
TARGET_BYTES_PER_SAMPLE = 100.0
BLOCK = 512
_HEADER_TEMPLATE = {
    100: b"0000644\0",  # mode
    108: b"0001750\0",  # uid
    116: b"0001750\0",  # gid
    136: b"14723545640\0",  # mtime
    148: b" " * 8,  # checksum, summed as spaces
    156: b"0",  # regular file
    257: b"ustar\x0000",
}


@dataclass(frozen=True)
class Measurement:
    source: str
    samples: int
    build_seconds: float
    build_cpu_seconds: float
    """Of this process: what the build costs on an idle core, whatever the neighbours do."""
    fingerprint_seconds: float
    index_bytes: int
    rss_retained: int
    rss_peak: int

    @property
    def bytes_per_sample(self) -> float:
        return self.index_bytes / self.samples

    @property
    def meets_targets(self) -> bool:
        return self.build_seconds < TARGET_SECONDS and self.bytes_per_sample < TARGET_BYTES_PER_SAMPLE


def _headers(names: Sequence[bytes], sizes: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """Valid ustar header blocks for regular members, built as one array (checksums included)."""
    blocks = np.zeros((len(names), BLOCK), dtype=np.uint8)
    for offset, value in _HEADER_TEMPLATE.items():
        blocks[:, offset : offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
    width = max(len(n) for n in names)
    blocks[:, :width] = np.frombuffer(b"".join(n.ljust(width, b"\0") for n in names), np.uint8).reshape(
        -1, width
    )
    octal = b"".join(b"%011o\0" % s for s in sizes.tolist())
    blocks[:, 124:136] = np.frombuffer(octal, dtype=np.uint8).reshape(-1, 12)
    sums = blocks.sum(axis=1, dtype=np.int64).tolist()
    blocks[:, 148:156] = np.frombuffer(b"".join(b"%06o\0 " % s for s in sums), np.uint8).reshape(-1, 8)
    return blocks


def write_shard(path: Path, first: int, count: int, rng: np.random.Generator) -> None:
    """``count`` samples (``KEY.jpg`` with a hole for data, ``KEY.cls``) as a sparse tar file."""
    image_sizes = rng.integers(40_000, 200_000, count)
    labels = rng.integers(0, 1000, count)
    keys = [b"%09d" % k for k in range(first, first + count)]
    jpg = _headers([k + b".jpg" for k in keys], image_sizes)
    cls_data = [b"%d" % v for v in labels.tolist()]
    cls = _headers([k + b".cls" for k in keys], np.array([len(d) for d in cls_data], dtype=np.int64))
    padded = (image_sizes + BLOCK - 1) // BLOCK * BLOCK
    starts = np.concatenate(([0], np.cumsum(BLOCK + padded + 2 * BLOCK)[:-1])).tolist()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for k in range(count):
            os.pwrite(fd, jpg[k].tobytes(), starts[k])
            cls_at = starts[k] + BLOCK + int(padded[k])
            os.pwrite(fd, cls[k].tobytes() + cls_data[k].ljust(BLOCK, b"\0"), cls_at)
        end = starts[-1] + BLOCK + int(padded[-1]) + 2 * BLOCK
        os.ftruncate(fd, end + 2 * BLOCK)  # the end-of-archive blocks are zeros
    finally:
        os.close(fd)


def write_tar(folder: Path, samples: int, shards: int, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = -(-samples // shards)
    for shard in range(shards):
        first = shard * per_shard
        count = min(per_shard, samples - first)
        if count > 0:
            write_shard(folder / f"train-{shard:06d}.tar", first, count, rng)
    return folder


def _list_rows(samples: int, seed: int) -> tuple[list[str], list[int]]:
    labels = np.random.default_rng(seed).integers(0, 1000, samples).tolist()
    paths = [f"train/n{label:08d}/n{label:08d}_{k}.JPEG" for k, label in enumerate(labels)]
    return paths, labels


def write_csv(path: Path, samples: int, seed: int) -> Path:
    paths, labels = _list_rows(samples, seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("path,label\n")
        f.writelines(f"{p},{label}\n" for p, label in zip(paths, labels, strict=True))
    return path


def write_jsonl(path: Path, samples: int, seed: int) -> Path:
    paths, labels = _list_rows(samples, seed)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"path": p, "label": label}) + "\n" for p, label in zip(paths, labels, strict=True)
        )
    return path


def measure_here(source: str, data: str) -> Measurement:
    """Index ``data`` in this process, as the service does at start."""
    from loader_service.dataset.index import build_index

    process = psutil.Process()
    before = process.memory_info().rss
    start, cpu = time.perf_counter(), time.process_time()
    index = build_index(data)
    built, cpu = time.perf_counter(), time.process_time() - cpu
    index.fingerprint()
    fingerprinted = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Measurement(
        source=source,
        samples=len(index),
        build_seconds=built - start,
        build_cpu_seconds=cpu,
        fingerprint_seconds=fingerprinted - built,
        index_bytes=index.nbytes,
        rss_retained=process.memory_info().rss - before,
        rss_peak=peak - before,
    )


def measure(source: str, data: Path) -> Measurement:
    """``measure_here`` in a fresh child process, so one source's garbage does not weigh on another."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.index_scale", "--measure", source, str(data)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"indexing {source} failed:\n{out.stderr[-4000:]}")
    return Measurement(**json.loads(out.stdout))


def format_table(results: Sequence[Measurement]) -> str:
    header = ("source", "samples", "build s", "CPU s", "fingerprint s", "index B/sample",
              "RSS kept B/sample", "RSS peak MB", "targets")  # fmt: skip
    rows = [header]
    for m in results:
        rows.append(
            (
                m.source,
                f"{m.samples:,}",
                f"{m.build_seconds:.1f}",
                f"{m.build_cpu_seconds:.1f}",
                f"{m.fingerprint_seconds:.2f}",
                f"{m.bytes_per_sample:.0f}",
                f"{m.rss_retained / m.samples:.0f}",
                f"{m.rss_peak / 2**20:.0f}",
                "met" if m.meets_targets else "MISSED",
            )
        )
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"targets: build under {TARGET_SECONDS:.0f} s, index under {TARGET_BYTES_PER_SAMPLE:.0f} B/sample"
    )
    return "\n".join(lines)


def run(samples: int, shards: int, folder: Path, seed: int, sources: Sequence[str]) -> list[Measurement]:
    results = []
    for source in sources:
        print(f"writing the {source} source ({samples:,} samples)...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        if source == "tar":
            data = write_tar(folder / "shards", samples, shards, seed)
        elif source == "csv":
            data = write_csv(folder / "list.csv", samples, seed)
        else:
            data = write_jsonl(folder / "list.jsonl", samples, seed)
        print(f"  written in {time.perf_counter() - start:.1f} s; indexing...", file=sys.stderr, flush=True)
        results.append(measure(source, data))
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.index_scale", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=100, help="tar shards the samples are split into")
    p.add_argument("--dir", type=Path, help="where to write the sources (default: a temp dir, removed after)")
    p.add_argument("--sources", default="tar,csv,jsonl", help="any of tar, csv, jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.add_argument("--measure", nargs=2, metavar=("SOURCE", "DATA"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(asdict(measure_here(*args.measure))))
        return 0
    sources = [s for s in args.sources.split(",") if s]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="index-scale-", dir=args.dir) as tmp:
        results = run(args.samples, args.shards, Path(tmp), args.seed, sources)
        print("removing the sources...", file=sys.stderr, flush=True)  # can take a while after writing GBs
    print(format_table(results))
    if args.json is not None:
        payload: list[dict[str, Any]] = [
            {**asdict(m), "bytes_per_sample": m.bytes_per_sample, "meets_targets": m.meets_targets}
            for m in results
        ]
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
