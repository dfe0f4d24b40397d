"""Scenario (n): the benchmark photos as tar shards in an object store, against the same shards on
local disk, in one run (NOTE [ Object store reads ], NOTE [ Fetch cache ]).

    python -m benchmarks.objectstore [--out DIR] [--quick] [--parts shards,reads,index]

The store is a real S3 server on this machine (SeaweedFS, ``testkit/s3server.py``): its latency
is loopback's, so the "20 ms" rows put the fault proxy (``testkit/netfaults.py``) in front of it,
holding every chunk 20 ms each way, as a store in another zone would. Each service has 2 decode
workers, batch 64, the built-in train transform at 224 px; one trainer (``ServiceLoader``) times
whole epochs. The parts:

* ``shards``: images/s of epochs 1 and 2 for: the local shards; the store with no cache folder (every
  image a ranged read); the store with an empty cache folder (``cold``: the start fetches each shard
  once to index it and keeps it, so its start time is reported too) and the same service's epoch 2
  (``warm``); the store through the 20 ms proxy, no cache folder. Ratios against the local shards'
  same epoch. Targets: cold >= 0.8x (epoch 1), warm >= 0.97x (epoch 2), 20 ms >= 0.7x (epoch 1).
* ``reads``: requests per batch and bytes read per image byte, counted on the reader the workers run
  (``ObjectFiles`` through ``SampleReader.prefetch``, in this process) over one epoch's batches.
* ``zip``: the photos as one deflated zip archive in the store: indexed from its central directory
  (seconds, bytes read of the archive), then an epoch's reads as ``reads`` counts them (target
  <= 1.05 bytes read per image byte). ``arrow`` and ``tfrecord``: the same for a ``save_to_disk``
  folder and for TFRecord files, whose files the scan fetches whole.
* ``index``: a saved index of ``--samples`` (default 1,000,000) tar samples: how long
  ``load_or_build`` takes to find it current and map it (target < 1 s), against indexing anew.

Every line printed is one measurement; all go to ``objectstore.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.module_output import say, write_results
from benchmarks.service_process import serving
from testkit.counting import CountingFiles, counted_store_reads

BATCH = 64
WORKERS = 2
PER_SHARD = 128
LATENCY = 0.02
TARGETS = {"cold": 0.8, "warm": 0.97, "proxy_20ms": 0.7, "proxy_20ms_cold": 0.7}


@dataclass(frozen=True)
class Plan:
    images: int
    image_size: int
    samples: int
    """Of the saved-index part."""
    rounds: int
    data: Path = Path()
    """The benchmark photos (an ImageFolder), once prepared."""


@dataclass
class Run:
    start_seconds: float
    epochs: list[float]
    """Images/s of each epoch."""
    service_cpu_ms: float = 0.0
    """CPU of the service's process tree per image, over both epochs: what the trainer's host pays."""
    store_cpu_ms: float = 0.0
    """CPU of the S3 server per image over both epochs: on this machine it shares the same cores."""


@contextmanager
def service(
    data: str, run_dir: Path, env: Mapping[str, str], plan: Plan, *flags: str
) -> Iterator[tuple[str, int]]:
    """A service over ``data`` (its endpoint and pid), stopped on the way out."""
    args = ["--data", data, "--workers", str(WORKERS)]
    args += [
        "--batch-size",
        str(BATCH),
        "--image-size",
        str(plan.image_size),
        "--log-level",
        "WARNING",
        *flags,
    ]
    with serving(run_dir, args, dict(env)) as started:
        yield started


def timed_epochs(endpoint: str, epochs: int, started: float, cpu: Callable[[], tuple[float, float]]) -> Run:
    """Seconds from ``started`` until the service answers, then each epoch's images/s, and the CPU
    ``cpu()`` says (service, store) was spent per image meanwhile."""
    from gpu_worker import ServiceLoader

    with ServiceLoader(endpoint, connect_timeout=600, timeout=120) as loader:
        ready = time.perf_counter() - started
        rates, before, total = [], cpu(), 0
        for _ in range(epochs):
            images, start = 0, time.perf_counter()
            for batch in loader:
                images += len(batch.indices)
            rates.append(images / (time.perf_counter() - start))
            total += images
        after = cpu()
    return Run(ready, rates, 1000 * (after[0] - before[0]) / total, 1000 * (after[1] - before[1]) / total)


def measure(data: str, run_dir: Path, env: Mapping[str, str], plan: Plan, store_pid: int, *flags: str) -> Run:
    from benchmarks.proctree import cpu_seconds, tree

    started = time.perf_counter()
    with service(data, run_dir, env, plan, *flags) as (endpoint, pid):
        return timed_epochs(endpoint, 2, started, lambda: (cpu_seconds(tree(pid)), cpu_seconds([store_pid])))


def shards_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """Every configuration once a round, the local shards first; ratios are medians of the rounds'."""
    rounds = [one_round(work, server, plan, r) for r in range(plan.rounds)]
    out: dict[str, Any] = {"rounds": [{name: run.__dict__ for name, run in runs.items()} for runs in rounds]}
    for name in rounds[0]:
        epoch = 1 if name == "warm" else 0
        ratio = float(np.median([runs[name].epochs[epoch] / runs["local"].epochs[epoch] for runs in rounds]))
        target = TARGETS.get(name)
        verdict = "-" if target is None else ("PASS" if ratio >= target else "FAIL")
        out[f"{name}_ratio"] = ratio
        last = rounds[-1][name]
        say(
            f"(n) {name}: epoch {epoch + 1} {ratio:.2f}x local (median of {plan.rounds}; target "
            f"{target or '-'}) {verdict}; last round: start {last.start_seconds:.1f} s, "
            f"{last.epochs[epoch]:.0f} images/s, CPU per image: service {last.service_cpu_ms:.2f} ms, "
            f"S3 server {last.store_cpu_ms:.2f} ms"
        )
    return out


def one_round(work: Path, server: Any, plan: Plan, r: int) -> dict[str, Run]:
    from testkit.netfaults import proxy_process

    shards, run_dir = work / "shards", work / "run"
    url = f"s3://{server.bucket}/shards/"
    env, store = server.env(), server.pid
    cache = ["--cache-size", "64G", "--cache-dir"]
    runs: dict[str, Run] = {"local": measure(str(shards), run_dir, {}, plan, store)}
    runs["store_no_cache"] = measure(url, run_dir, env, plan, store)
    runs["cold"] = runs["warm"] = measure(url, run_dir, env, plan, store, *cache, str(work / f"cache{r}"))
    with proxy_process(("127.0.0.1", server.port), LATENCY) as proxied:
        far = {**env, "AWS_ENDPOINT_URL": proxied.replace("tcp://", "http://")}
        runs["proxy_20ms"] = measure(url, run_dir, far, plan, store)
        runs["proxy_20ms_cold"] = measure(url, run_dir, far, plan, store, *cache, str(work / f"far{r}"))
    return runs


def reads_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """Requests and bytes of one epoch's reads, counted on the reader the workers run."""
    out = _epoch_reads(server, f"s3://{server.bucket}/shards/")
    say(f"(n) reads: {out['requests_per_batch']:.1f} requests a batch of {BATCH}, "
        f"{out['bytes_read_per_image_byte']:.3f} bytes read per image byte")  # fmt: skip
    return out


def zip_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """The photos as one zip archive (deflated, as ``zip -r`` makes it) in the store: its index from
    the central directory alone, and an epoch's reads (target <= 1.05 bytes read per image byte)."""
    from benchmarks.datasets import make_zip
    from loader_service.dataset.index import build_index

    archive = make_zip(build_index(plan.data), work / "zip")
    server.upload(archive, "zip/train.zip")
    out = _epoch_reads(server, f"s3://{server.bucket}/zip/train.zip")
    return _said("a zip archive", out, f"from {out['index_bytes']} bytes of its {archive.stat().st_size}")


def arrow_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """The photos as a ``save_to_disk`` folder in the store: indexed (each file fetched once to be
    walked), then an epoch's reads (target <= 1.05 bytes read per image byte)."""
    from benchmarks.datasets import make_saved
    from loader_service.dataset.index import build_index

    server.upload_tree(make_saved(build_index(plan.data), work / "saved"), "saved")
    return _said(
        "a save_to_disk folder", _epoch_reads(server, f"s3://{server.bucket}/saved/"), "fetched whole"
    )


def tfrecord_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """The photos as TFRecord files in the store: indexed (each file fetched once to be walked),
    then an epoch's reads, each record's checksum checked (target <= 1.05 bytes per image byte)."""
    from benchmarks.datasets import make_tfrecords
    from loader_service.dataset.index import build_index

    server.upload_tree(make_tfrecords(build_index(plan.data), work / "tfr"), "tfr")
    return _said("TFRecord files", _epoch_reads(server, f"s3://{server.bucket}/tfr/"), "fetched whole")


def _said(what: str, out: dict[str, Any], how: str) -> dict[str, Any]:
    read = out["bytes_read_per_image_byte"]
    verdict = "PASS" if read <= 1.05 else "FAIL"
    say(f"(n) {what} in the store: indexed in {out['index_seconds']:.2f} s ({how}); "
        f"{out['requests_per_batch']:.1f} requests a batch, {read:.4f} bytes read per image byte "
        f"(target <= 1.05) {verdict}")  # fmt: skip
    return out


def _epoch_reads(server: Any, url: str) -> dict[str, Any]:
    """The data at ``url`` indexed (its reads counted), then one epoch read in batches as a worker
    reads them: requests a batch and bytes read per image byte."""
    from loader_service.dataset.index import build_index
    from loader_service.dataset.sampler import shard_order
    from loader_service.dataset.storage import objectfolder
    from loader_service.dataset.storage.storeconfig import StorageConfig
    from loader_service.decode.reading import SampleReader

    scanned: list[int] = []
    ranged = objectfolder.RangedFile.readinto

    def counting(self: Any, buffer: Any) -> int:
        got = ranged(self, buffer)
        scanned.append(got)
        return got

    with _environ(server.env()):
        storage = StorageConfig()
        objectfolder.RangedFile.readinto = counting  # type: ignore[method-assign]
        try:
            started = time.perf_counter()
            index = build_index(url, storage=storage)
            index_seconds = time.perf_counter() - started
        finally:
            objectfolder.RangedFile.readinto = ranged  # type: ignore[method-assign]
        reader = SampleReader(index, 1 << 28, storage)
        try:
            with counted_store_reads() as fetched:
                order, image_bytes = shard_order(0, 0, len(index), 0, 1, "pad"), 0
                batches = -(-len(index) // BATCH)
                for b in range(batches):
                    batch = [int(i) for i in order.batch(b, BATCH)]
                    reader.prefetch(batch)
                    image_bytes += sum(len(reader.image_bytes(i)) for i in batch)
        finally:
            reader.close()
    return {
        "requests_per_batch": len(fetched) / batches,
        "bytes_read_per_image_byte": sum(fetched) / image_bytes,
        "index_seconds": index_seconds,
        "index_bytes": sum(scanned),
    }


def index_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """A saved index of ``plan.samples`` tar samples found current and made ready as a service start
    makes it (``load_or_build``, saved into the runtime folder, mapped, fingerprinted; target < 1 s),
    against indexing anew."""
    from benchmarks.index_scale import write_tar
    from loader_service.dataset.index import load_or_build
    from loader_service.dataset.storage.storeconfig import StorageConfig

    folder = write_tar(work / "big", plan.samples, max(1, plan.samples // 10_000), seed=1)
    storage = StorageConfig(cache_dir=str(work / "index-cache"), cache_size=64 << 30)
    first = _seconds(lambda: _started(load_or_build(folder, "tar", None, storage), work / "runtime"))
    again = min(
        _seconds(lambda: _started(load_or_build(folder, "tar", None, storage), work / "runtime"))
        for _ in range(3)
    )
    verdict = "PASS" if again < 1.0 else "FAIL"
    say(f"(n) index: {plan.samples} samples indexed in {first:.1f} s; the saved index ready in {again:.2f} s "
        f"(target < 1 s) {verdict}")  # fmt: skip
    return {"samples": plan.samples, "scan_seconds": first, "saved_seconds": again}


def _started(index: Any, runtime: Path) -> str:
    """What ``Feed.open`` does with an index: save it for the workers, map the copy, fingerprint it."""
    import shutil

    from loader_service.dataset.index import DatasetIndex

    shutil.rmtree(runtime, ignore_errors=True)
    runtime.mkdir()
    index.save(runtime)
    return DatasetIndex.load(runtime).fingerprint()


def parquet_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """The photos as the Parquet files ``datasets`` writes, against the same photos as tar shards, both
    local: epoch rates in alternating rounds, and bytes read per image byte on the workers' reader."""
    from testkit.fixtures import write_parquet

    folder = write_parquet(plan.data, work / "parquet", files=4)
    rounds = []
    for _ in range(plan.rounds):
        tar = measure(str(work / "shards"), work / "run", {}, plan, server.pid)
        pq = measure(str(folder), work / "run", {}, plan, server.pid)
        rounds.append((tar.epochs[0] / pq.epochs[0], tar, pq))
    ratio = float(np.median([pq.epochs[0] / tar.epochs[0] for _, tar, pq in rounds]))
    verdict = "PASS" if ratio >= 0.9 else "FAIL"
    say(
        f"(n) parquet (local) against tar (local): epoch 1 {ratio:.2f}x "
        f"(median of {plan.rounds}; target 0.9) {verdict}"
    )
    read = _parquet_bytes_read(folder)
    say(f"(n) parquet: {read:.4f} bytes read per image byte over an epoch")
    return {
        "ratio": ratio,
        "bytes_read_per_image_byte": read,
        "rounds": [(t.__dict__, q.__dict__) for _, t, q in rounds],
    }


def _parquet_bytes_read(folder: Path) -> float:
    from loader_service.dataset.formats.parquet import format as parquet
    from loader_service.dataset.formats.parquet.reader import ParquetReader
    from loader_service.dataset.index import build_index

    index = build_index(folder)
    files = CountingFiles(index.root)
    reader = ParquetReader(files, parquet._rows(index), 1 << 28, exact=True)
    images = sum(
        len(reader.image_bytes(i)) for i in np.random.default_rng(0).permutation(len(index)).tolist()
    )
    return files.bytes_read / images


def parquet_index_part(work: Path, server: Any, plan: Plan) -> dict[str, Any]:
    """A Parquet index of ``plan.samples`` rows from footers and the label column (target < 5 s)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loader_service.dataset.index import build_index

    folder, files = work / "big-parquet", 10
    folder.mkdir()
    rows = plan.samples // files
    rng = np.random.default_rng(1)
    for k in range(files):  # tiny images: the index reads no image byte, only how many there are
        image = pa.array([{"bytes": b"\xff\xd8", "path": f"{k}/{i}.jpg"} for i in range(rows)])
        labels = pa.array(rng.integers(0, 1000, rows))
        pq.write_table(
            pa.table({"image": image, "label": labels}), folder / f"part-{k:03d}.parquet", row_group_size=1000
        )
    seconds = min(_seconds(lambda: build_index(folder)) for _ in range(2))
    verdict = "PASS" if seconds < 5.0 else "FAIL"
    say(
        f"(n) parquet index: {rows * files} rows in {files} files from footers in {seconds:.2f} s "
        f"(target < 5 s) {verdict}"
    )
    return {"rows": rows * files, "seconds": seconds}


def _seconds(job: Callable[[], object]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PARTS: dict[str, Callable[[Path, Any, Plan], dict[str, Any]]] = {
    "shards": shards_part,
    "reads": reads_part,
    "parquet": parquet_part,
    "index": index_part,
    "parquet_index": parquet_index_part,
    "zip": zip_part,
    "arrow": arrow_part,
    "tfrecord": tfrecord_part,
}


def prepare(work: Path, server: Any, plan: Plan, quick: bool) -> Plan:
    """The benchmark photos as shards, on disk and in the store."""
    from benchmarks.config import make_config
    from benchmarks.datasets import prepare_data
    from testkit.fixtures import write_shards

    data = prepare_data(make_config(quick, images=plan.images))
    count = len(write_shards(data.root, work / "shards", PER_SHARD))
    server.upload_tree(work / "shards", "shards")
    say(f"(n) {data.images} photos ({data.mean_kib:.0f} KiB on average) in {count} shards of {PER_SHARD}")
    return replace(plan, data=data.root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.objectstore", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default="bench-results", help="where objectstore.json goes")
    parser.add_argument("--quick", action="store_true", help="fewer photos, a 100,000-sample index")
    parser.add_argument("--samples", type=int, default=0, help="samples of the saved-index part")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    plan = (
        Plan(images=1024, image_size=224, samples=args.samples or 100_000, rounds=1)
        if args.quick
        else Plan(images=2560, image_size=224, samples=args.samples or 1_000_000, rounds=3)
    )
    from testkit.s3server import S3Server

    results: dict[str, Any] = {"plan": {k: str(v) for k, v in plan.__dict__.items()}}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-objectstore-")))
        (work / "run").mkdir()
        server = stack.enter_context(S3Server(work / "s3"))
        plan = prepare(work, server, plan, args.quick)
        for part in parts:
            results[part] = PARTS[part](work, server, plan)
    write_results(args.out, "objectstore", results)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
