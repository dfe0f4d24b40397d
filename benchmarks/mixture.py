"""A mixture of three sources (issue 38): dataferry's weighted feed against one source, and against
the peers that mix datasets by weight, in one run.

    python -m benchmarks.mixture [--images N] [--workers N] [--rounds N] [--batches N]
                                 [--weights A,B,C] [--quick] [--json F]

The generated sample dataset (``benchmarks.datasets.prepare_data``, cached) is split, class by
class, into three ImageFolders ``a``, ``b`` and ``c`` of 50 %, 30 % and 20 % of the images (hard
links: the very files). Every contender decodes with ``--workers`` single-threaded processes,
RandomResizedCrop 224 + flip, batches of 64:

* ``three``: ``loader-service serve --source a=... --source b=... --source c=...`` read with
  ``ServiceLoader(weights={"a": .5, "b": .3, "c": .2}, epoch_samples=images)``;
* ``one``: ``loader-service serve --data`` over the undivided dataset, read without weights;
* ``hf``: Hugging Face ``datasets.interleave_datasets`` of the three (each shuffled with the seed;
  ``probabilities`` = the weights, ``stopping_strategy="all_exhausted"``), made an IterableDataset
  with ``to_iterable_dataset(num_shards=workers)`` so that each DataLoader worker reads its share,
  in a ``DataLoader(num_workers=workers, persistent_workers=True)`` whose Dataset decodes each row
  with the service's ``decode_file`` + ``transform_into`` (the ``dl_opencv`` path of
  ``benchmarks.datasets``): a torch IterableDataset around the HF one, not ``IterableDataset.map``,
  which halved HF's images/s on 2 cores (its per-row formatting), so the peer runs at its better;
* ``torchdata`` (where ``torchdata.nodes`` imports): ``MultiNodeWeightedSampler`` over the three
  (its default ``CYCLE_UNTIL_ALL_DATASETS_EXHAUSTED``), ``ParallelMapper(method="process")`` with
  the same decode (``prebatch=8``), ``Batcher``, collate, ``Prefetcher``, ``Loader``.

Timed in interleaved rounds as scenario (a) times its contenders (``scenarios.interleaved_rounds``:
the process tree idle first, buffered batches and a warm-up skipped, then ``--batches`` batches,
the order rotating each round). Reported: images/s and CPU-seconds per 1000 images of each; three
over one (target >= 0.95x) and three over each peer (target >= 1.2x), each the median of the
per-round ratios with its spread (the largest distance of a round's ratio from that median); and
each mixture's realized share of every source over its timed batches next to the weights asked.
The table goes to stdout, progress to stderr, everything to ``--json``. Exit code 0: it ran,
whatever the targets say; 1: a process failed or timed out; 2: a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import itertools
import json
import math
import multiprocessing.resource_tracker
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, IterableDataset

from benchmarks.cli import run_benchmark
from benchmarks.config import BenchConfig, ConfigError
from benchmarks.contenders import Contender, Stream, Tick, batch_rows, loader_stream
from benchmarks.datasets import DataSpec, prepare_data, single_threaded_worker
from benchmarks.machine import machine_facts
from benchmarks.proctree import service_segments, tree
from benchmarks.progress import LazyProgress, say
from benchmarks.run import DATALOADER_PREFETCH, SERVICE_CREDITS
from benchmarks.scenarios import interleaved_rounds
from benchmarks.service_process import BenchError, ServiceProcess, ServiceSpec, running_service
from benchmarks.stats import median, paired_ratio, ratio
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.decoders import describe_decoder
from loader_service.decode.transforms import Recipe, decode_file, transform_into

NAMES = ("a", "b", "c")
SPLIT = (0.5, 0.3, 0.2)
"""Each source's part of the images, class by class."""
WEIGHTS = (0.5, 0.3, 0.2)
BATCH = 64
SIZE = 224
DECODER = "auto"
THREE, ONE, HF, TORCHDATA = "three", "one", "hf", "torchdata"
TITLES = {
    THREE: "dataferry, three sources, weighted",
    ONE: "dataferry, one source (--data)",
    HF: "HF interleave_datasets + DataLoader",
    TORCHDATA: "torchdata MultiNodeWeightedSampler",
}
TARGETS = {ONE: 0.95, HF: 1.2, TORCHDATA: 1.2}
"""``three`` over each other contender: at least this (issue 38)."""
TORCHDATA_PREBATCH = 8
"""Samples ``ParallelMapper`` sends a worker at once: 15-20 % more images/s than one at a time (its
default) on 2 cores, so the peer is timed at its better setting."""
TORCHDATA_PREFETCH = 2
"""Batches its ``Prefetcher`` holds; with the mapper's 2 x workers samples in flight, about what
may wait for it after it idled (its backlog: one batch more)."""
UNCOUNTED_CPU = {TORCHDATA}
"""Contenders whose CPU the segments cannot count: torchdata starts its worker processes anew at
every epoch, and a process that was not there when a segment began, or is gone when it ends, is
not counted (``proctree``); its CPU per 1000 images is reported as not measured."""
REAP_GRACE = 10.0
"""Seconds the run's worker processes get to exit on their own once their loaders are closed."""
Row = tuple[str, int, int]
"""(path, label, source) of one sample, as the peers read it."""


@dataclass(frozen=True)
class Plan:
    images: int = 2560
    workers: int = 2
    rounds: int = 3
    batches: int = 30
    """Batches timed per contender per round."""
    warmup: int = 4
    """Batches skipped before each timed segment, on top of what a contender may have buffered."""
    weights: tuple[float, ...] = WEIGHTS
    seed: int = 0
    timeout: float = 120.0
    quick: bool = False


QUICK = {"images": 384, "batches": 4, "warmup": 2, "timeout": 60.0}
"""What ``--quick`` changes: 6 batches of 64 an epoch; a check that everything runs, not for quoting."""


# --- data --------------------------------------------------------------------------------------------


def split_counts(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` items in parts of ``shares`` (largest remainder), summing to ``total``."""
    whole = sum(shares)
    exact = [total * s / whole for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_sources(index: DatasetIndex, dest: Path, shares: Sequence[float] = SPLIT) -> dict[str, Path]:
    """The images of ``index`` as one ImageFolder per name of ``NAMES`` under ``dest``: each class's
    files, in index order, cut in parts of ``shares``; hard links (copies across file systems)."""
    folders = {name: dest / name for name in NAMES}
    by_class: dict[int, list[int]] = {}
    for i in range(len(index)):
        by_class.setdefault(int(index.labels[i]), []).append(i)
    for members in by_class.values():
        start = 0
        for name, count in zip(NAMES, split_counts(len(members), shares), strict=True):
            for i in members[start : start + count]:
                target = folders[name] / index.relpath(i)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(index.path(i), target)
                except OSError:
                    shutil.copyfile(index.path(i), target)
            start += count
    return folders


def source_rows(indexes: Sequence[DatasetIndex]) -> list[list[Row]]:
    """Each source's samples as the peers read them, in index order."""
    return [
        [(str(index.path(i)), int(index.labels[i]), s) for i in range(len(index))]
        for s, index in enumerate(indexes)
    ]


# --- the peers ---------------------------------------------------------------------------------------


class RowDecoder:
    """One row to ``{"image": CHW uint8, "label", "source"}`` with the service's own ``decode_file``
    and ``transform_into`` (a full decode, as ``OpenCVCrops``); one OpenCV thread and one generator
    per process."""

    def __init__(self, recipe: Recipe, size: int) -> None:
        self.recipe = Recipe(recipe.augment, recipe.interpolation)
        self.size = size
        self._rng: np.random.Generator | None = None
        self._pid = -1

    def rng(self) -> np.random.Generator:
        if self._rng is None or self._pid != os.getpid():
            cv2.setNumThreads(1)  # a torchdata worker has no worker_init_fn
            self._rng = np.random.default_rng()
            self._pid = os.getpid()
        return self._rng

    def __call__(self, row: Row) -> dict[str, Any]:
        path, label, source = row
        out = np.empty((3, self.size, self.size), dtype=np.uint8)
        transform_into(decode_file(path), out, self.recipe, self.rng())
        return {"image": torch.from_numpy(out), "label": label, "source": source}


class DecodedRows(IterableDataset[dict[str, Any]]):
    """A Hugging Face IterableDataset's rows, decoded. Iterated in a DataLoader worker, the
    IterableDataset gives that worker its own shards (``datasets`` reads the worker's number)."""

    def __init__(self, rows: Iterable[Mapping[str, Any]], decode: RowDecoder) -> None:
        self.rows = rows
        self.decode = decode

    def __iter__(self) -> Any:
        for row in self.rows:
            yield self.decode((row["path"], row["label"], row["source"]))


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def peer_problem(module: str, distribution: str) -> str:
    """Why the peer in ``module`` cannot run here ("" if it can)."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{module} does not import ({type(exc).__name__}: {exc}); pip install {distribution}"
    return ""


def hf_loader(rows: Sequence[Sequence[Row]], plan: Plan, decode: RowDecoder) -> DataLoader[dict[str, Any]]:
    """``interleave_datasets`` of the sources as a DataLoader user writes it (module docstring)."""
    hf: Any = importlib.import_module("datasets")
    hf.disable_progress_bars()
    parts = [
        hf.Dataset.from_dict(
            {"path": [r[0] for r in part], "label": [r[1] for r in part], "source": [r[2] for r in part]}
        ).shuffle(seed=plan.seed)
        for part in rows
    ]
    mixed = hf.interleave_datasets(
        parts, probabilities=list(plan.weights), seed=plan.seed, stopping_strategy="all_exhausted"
    )
    iterable = mixed.flatten_indices().to_iterable_dataset(num_shards=plan.workers)
    return DataLoader(
        DecodedRows(iterable, decode),
        batch_size=BATCH,
        num_workers=plan.workers,
        persistent_workers=True,
        worker_init_fn=single_threaded_worker,
        timeout=plan.timeout,
    )


def torchdata_loader(rows: Sequence[Sequence[Row]], plan: Plan, decode: RowDecoder) -> Iterable[Any]:
    """``torchdata.nodes``: weighted sampling over the sources, the decode in worker processes."""
    nodes: Any = importlib.import_module("torchdata.nodes")
    order = random.Random(plan.seed)
    sources = {}
    for name, part in zip(NAMES, rows, strict=True):
        shuffled = list(part)
        order.shuffle(shuffled)
        sources[name] = nodes.IterableWrapper(shuffled)
    weights = dict(zip(NAMES, plan.weights, strict=True))
    node = nodes.MultiNodeWeightedSampler(sources, weights, rank=0, world_size=1, seed=plan.seed)
    node = nodes.ParallelMapper(
        node, decode, num_workers=plan.workers, method="process", prebatch=TORCHDATA_PREBATCH
    )
    node = nodes.Batcher(node, BATCH, drop_last=False)
    node = nodes.Mapper(node, torch.utils.data.default_collate)
    node = nodes.Prefetcher(node, TORCHDATA_PREFETCH)
    loader: Iterable[Any] = nodes.Loader(node)
    return loader


# --- contenders --------------------------------------------------------------------------------------


class Sourced(Contender):
    """A contender whose timed batches' rows are counted by source (``counts``): the realized
    mixture. The sources of each batch are copied before it is released and counted after the
    batch's time was taken."""

    def __init__(
        self,
        key: str,
        loader: Iterable[Any],
        sources_of: Callable[[Any], torch.Tensor],
        backlog: int,
        warmup: int,
    ) -> None:
        self.counts = np.zeros(len(NAMES), np.int64)
        self._last: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._sources_of = sources_of
        super().__init__(key, self._batches(loader), backlog, warmup)

    def _batches(self, loader: Iterable[Any]) -> Stream:
        """``loader_stream``, keeping each batch's sources."""
        for epoch in itertools.count():
            position = 0
            for batch in loader:
                self._last = self._sources_of(batch).numpy().astype(np.int64)  # a copy
                images = batch_rows(batch)
                del batch
                yield Tick(epoch, position, images)
                position += 1
            if position == 0:
                raise BenchError(f"{self.key}: epoch {epoch} delivered no batch")

    def timed_pull(self) -> tuple[Tick, float]:
        tick, took = super().timed_pull()
        self.counts += np.bincount(self._last, minlength=len(NAMES))[: len(NAMES)]
        return tick, took


def shares_of(counts: Sequence[int]) -> list[float]:
    total = sum(counts)
    return [c / total if total else math.nan for c in counts]


# --- results (pure) ----------------------------------------------------------------------------------


def ratio_summary(first: Sequence[float], second: Sequence[float], target: float) -> dict[str, Any]:
    """``first / second`` per round: the median, its spread (the largest distance of a round's ratio
    from the median), every round's, and the target."""
    per_round = [r for a, b in zip(first, second, strict=True) if (r := ratio(a, b)) is not None]
    middle = paired_ratio(first, second)
    spread = max((abs(r - middle) for r in per_round), default=math.nan) if middle is not None else math.nan
    return {
        "median": middle,
        "spread": spread,
        "per_round": per_round,
        "target": target,
        "met": middle is not None and middle >= target,
    }


def summarize(
    rates: Mapping[str, Sequence[float]],
    cpu: Mapping[str, Sequence[float]],
    counts: Mapping[str, Sequence[int]],
    weights: Sequence[float],
) -> dict[str, Any]:
    """Medians, the ratios of ``three`` to every other contender timed, realized shares."""
    whole = sum(weights)
    return {
        "median_images_per_s": {k: median(v) for k, v in rates.items()},
        "median_cpu_s_per_1000": {k: None if k in UNCOUNTED_CPU else median(v) for k, v in cpu.items()},
        "rates": {k: list(v) for k, v in rates.items()},
        "cpu_s_per_1000": {k: list(v) for k, v in cpu.items()},
        "ratios": {
            f"{THREE}_over_{other}": ratio_summary(rates[THREE], rates[other], TARGETS[other])
            for other in rates
            if other != THREE
        },
        "weights": dict(zip(NAMES, (w / whole for w in weights), strict=True)),
        "realized_shares": {k: dict(zip(NAMES, shares_of(c), strict=True)) for k, c in counts.items()},
        "rows_counted": {k: int(sum(c)) for k, c in counts.items()},
    }


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_table(summary: Mapping[str, Any], skipped: Mapping[str, str]) -> str:
    """The printed tables: a row per contender, per ratio, per source."""
    rates, cpu = summary["median_images_per_s"], summary["median_cpu_s_per_1000"]
    lines = ["| contender | images/s | per round | CPU-s / 1000 images |", "| --- | ---: | --- | ---: |"]
    for key, value in rates.items():
        rounds = " ".join(_num(r, ".0f") for r in summary["rates"][key])
        lines.append(f"| {TITLES[key]} | {_num(value, '.0f')} | {rounds} | {_num(cpu[key], '.2f')} |")
    lines += ["", "| ratio | median | spread | per round | target |", "| --- | ---: | ---: | --- | --- |"]
    for name, r in summary["ratios"].items():
        other = name.removeprefix(f"{THREE}_over_")
        verdict = "PASS" if r["met"] else "FAIL"
        rounds = " ".join(f"{x:.2f}" for x in r["per_round"])
        lines.append(
            f"| three sources / {TITLES[other]} | {_num(r['median'], '.2f')}x | "
            f"±{_num(r['spread'], '.2f')} | {rounds} | >= {r['target']}x {verdict} |"
        )
    realized = summary["realized_shares"]
    head = " | ".join(f"realized, {TITLES[k]}" for k in realized)
    lines += ["", f"| source | weight | {head} |", "| --- | ---: |" + " ---: |" * len(realized)]
    for name in NAMES:
        got = " | ".join(_num(realized[k][name], ".3f") for k in realized)
        lines.append(f"| {name} | {summary['weights'][name]:.3f} | {got} |")
    lines += [f"skipped {TITLES[k]}: {why}" for k, why in skipped.items()]
    return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------------------


def _descendants() -> list[int]:
    """Live descendants of this process, but multiprocessing's resource tracker (it ends with us)."""
    tracker = getattr(getattr(multiprocessing.resource_tracker, "_resource_tracker", None), "_pid", None)
    return [pid for pid in tree(os.getpid()) if pid not in (os.getpid(), tracker)]


def reap_children(grace: float = REAP_GRACE) -> list[int]:
    """Descendants of this process still alive ``grace`` seconds after every loader closed
    (DataLoader or torchdata workers a failure left behind): killed, their pids returned. Workers
    that are merely slow to exit (torchdata joins its own for half a second) are not counted."""
    deadline = time.monotonic() + grace
    gc.collect()  # a loader in a reference cycle stops its workers only when collected
    while (left := _descendants()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    return left


PEERS = {HF: ("datasets", "datasets"), TORCHDATA: ("torchdata.nodes", "torchdata")}
"""Each peer's module, and the distribution that provides it."""


@dataclass(frozen=True)
class Sources:
    """The run's images, whole and split in three."""

    root: Path
    folders: dict[str, Path]
    sizes: list[int]
    rows: list[list[Row]]


def make_sources(root: Path, images: int, work: Path) -> Sources:
    folders = split_sources(build_index(root), work / "sources")
    indexes = [build_index(folders[name]) for name in NAMES]
    sizes = [len(i) for i in indexes]
    if sum(sizes) != images:
        raise BenchError(f"the three sources hold {sum(sizes)} images, the dataset {images}")
    say(f"sources {', '.join(f'{n}: {s}' for n, s in zip(NAMES, sizes, strict=True))} images")
    return Sources(root, folders, sizes, source_rows(indexes))


class MixtureRun:
    """The processes of one run, on ``stack``: two services, the peers, four contenders."""

    def __init__(self, plan: Plan, sources: Sources, run_dir: Path, interpolation: str) -> None:
        self.plan = plan
        self.sources = sources
        self.run_dir = run_dir
        self.interpolation = interpolation
        self.services: list[ServiceProcess] = []

    def service(self, stack: contextlib.ExitStack, name: str, sources: bool) -> str:
        """A ready service for the rest of ``stack``: stopped cleanly (exit 0, no segment left) or
        killed with its group on any failure (NOTE [ Benchmark service lifecycle ]); its endpoint."""
        plan = self.plan
        named = tuple((n, self.sources.folders[n]) for n in NAMES) if sources else ()
        spec = ServiceSpec(
            self.sources.root,
            f"ipc://{self.run_dir}/{name}.sock",
            plan.workers,
            BATCH,
            SIZE,
            seed=plan.seed,
            extra_args=("--decoder", DECODER, "--interpolation", self.interpolation),
            sources=named,
        )
        self.services.append(stack.enter_context(running_service(spec, self.run_dir / f"{name}.log")))
        return spec.endpoint

    def peers(self, stack: contextlib.ExitStack, skipped: Mapping[str, str]) -> dict[str, Contender]:
        """The peers' loaders, their workers started (the first batch taken)."""
        plan = self.plan
        decode = RowDecoder(Recipe("train", self.interpolation), SIZE)
        made: dict[str, tuple[Iterable[Any], int]] = {}
        if HF not in skipped:
            made[HF] = hf_loader(self.sources.rows, plan, decode), DATALOADER_PREFETCH * plan.workers
        if TORCHDATA not in skipped:
            made[TORCHDATA] = torchdata_loader(self.sources.rows, plan, decode), TORCHDATA_PREFETCH + 1
        out: dict[str, Contender] = {}
        for key, (loader, backlog) in made.items():
            out[key] = Sourced(key, loader, lambda b: b["source"], backlog, plan.warmup)
            stack.callback(out[key].close)
            out[key].pull()
        return out

    def dataferry(self, stack: contextlib.ExitStack, three_at: str, one_at: str) -> dict[str, Contender]:
        """A weighted trainer on the three sources' service, a plain one on the one-source service."""
        from gpu_worker import ServiceLoader

        plan = self.plan
        three = ServiceLoader(
            three_at,
            device="cpu",
            timeout=plan.timeout,
            credits=SERVICE_CREDITS,
            weights=dict(zip(NAMES, plan.weights, strict=True)),
            epoch_samples=sum(self.sources.sizes),
        )
        stack.callback(three.close)
        if tuple(three.sources) != NAMES:
            raise BenchError(f"the mixture's sources are {three.sources}, not {NAMES}")
        one = ServiceLoader(one_at, device="cpu", timeout=plan.timeout, credits=SERVICE_CREDITS)
        stack.callback(one.close)
        out = {
            THREE: Sourced(THREE, three, lambda b: b.sources, SERVICE_CREDITS, plan.warmup),
            ONE: Contender(ONE, loader_stream(one), SERVICE_CREDITS, plan.warmup),
        }
        for c in out.values():
            stack.callback(c.close)  # runs before its loader closes
        return out

    def measure(self, skipped: Mapping[str, str]) -> dict[str, Any]:
        """Every contender started in the order NOTE [ Scenario order ] (run.py) asks, timed in
        interleaved rounds; everything stopped after, on success and failure alike."""
        plan = self.plan
        with contextlib.ExitStack() as stack:
            say(f"starting two services, {plan.workers} workers each")
            three_at = self.service(stack, "three", sources=True)
            one_at = self.service(stack, "one", sources=False)
            # Whatever forks its workers does so before this process starts ZeroMQ threads;
            # torchdata forks its workers again at every epoch, as it always does.
            peers = self.peers(stack, skipped)
            timed = {**self.dataferry(stack, three_at, one_at), **peers}
            label = f"mixture rounds ({', '.join(timed)})"
            got = interleaved_rounds(list(timed.values()), plan.rounds, plan.batches, label)
            counts = {k: c.counts.tolist() for k, c in timed.items() if isinstance(c, Sourced)}
        return summarize(got.rates, got.cpu_per_1000, counts, plan.weights)


@dataclass
class Setting:
    """What a mixture benchmark (this one, ``benchmarks.mixture_sharing``) runs on: the sample
    dataset split into the three sources in a scratch folder, a folder for the services' files,
    and, once it is over, the processes it left behind (killed)."""

    started: str
    begin: float
    cfg: BenchConfig
    data: DataSpec
    sources: Sources | None = None
    run_dir: Path | None = None
    left: list[int] = field(default_factory=list)

    def record(
        self, plan: Mapping[str, Any], services: Sequence[ServiceProcess], **own: Any
    ) -> dict[str, Any]:
        """The run's JSON: what both benchmarks record (``plan``: the run's, as a dict), with ``own``
        (the figures) in between."""
        assert self.sources is not None
        return {
            "started": self.started,
            "seconds": time.monotonic() - self.begin,
            "plan": dict(plan),
            "data": self.data.public(),
            "sources": dict(zip(NAMES, self.sources.sizes, strict=True)),
            "image_size": SIZE,
            "interpolation": self.cfg.interpolation,
            "decoder_used": describe_decoder(DECODER),
            "machine": machine_facts(),
            **own,
            "cleanup": {
                "service_exit_codes": [s.exit_code for s in services],
                "segments_left": sum(len(service_segments(s.pid)) for s in services),
                "workers_killed": len(self.left),
            },
        }


def setting(images: int, seed: int, cache: Path) -> Setting:
    """The sample dataset of ``images`` photos (generated once into ``cache``, then reused)."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    begin = time.monotonic()
    cv2.setNumThreads(1)
    cfg = replace(BenchConfig(), images=images, cache=cache, seed=seed)
    generation = LazyProgress("generating the sample dataset")
    data = prepare_data(cfg, progress=generation)
    generation.close()
    say(data.describe())
    return Setting(started, begin, cfg, data)


@contextlib.contextmanager
def split(run: Setting, prefix: str) -> Iterator[Setting]:
    """``run`` with its sources and run folder in a scratch folder, removed afterwards, and every
    process left behind killed (``reap_children``) however the run ends."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        run.sources = make_sources(run.data.root, run.data.images, Path(scratch))
        run.run_dir = Path(scratch) / "run"
        run.run_dir.mkdir()
        try:
            yield run
        finally:
            run.left = reap_children()
            if run.left:
                say(f"killed {len(run.left)} process(es) left behind: {run.left}")


def run(plan: Plan, cache: Path) -> dict[str, Any]:
    setup = setting(plan.images, plan.seed, cache)
    skipped = {k: why for k, (module, dist) in PEERS.items() if (why := peer_problem(module, dist))}
    for key, why in skipped.items():
        say(f"{TITLES[key]} skipped: {why}")
    with split(setup, "dataferry-mixture-") as ready:
        assert ready.sources is not None and ready.run_dir is not None
        bench = MixtureRun(plan, ready.sources, ready.run_dir, ready.cfg.interpolation)
        summary = bench.measure(skipped)
    return setup.record(
        asdict(plan),
        bench.services,
        batch_size=BATCH,
        peers={dist: _version(dist) for _, dist in PEERS.values()},
        skipped=skipped,
        **summary,
    )


def parse_weights(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers: {text!r}") from None
    if len(values) != len(NAMES) or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"three weights >= 0, not all zero, for {','.join(NAMES)}: {text!r}")
    return values


def make_plan(args: argparse.Namespace) -> Plan:
    plan = replace(Plan(), **QUICK, quick=True) if args.quick else Plan()  # type: ignore[arg-type]
    chosen = {k: getattr(args, k) for k in ("images", "workers", "rounds", "batches", "weights")}
    plan = replace(plan, **{k: v for k, v in chosen.items() if v is not None})
    for name in ("workers", "rounds", "batches"):
        if getattr(plan, name) < 1:
            raise ConfigError(f"--{name} must be at least 1")
    if plan.images < 2 * BATCH:
        raise ConfigError(f"--images must be at least {2 * BATCH}")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mixture", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--images", type=int, help="size of the generated dataset (default 2560; quick 384)")
    parser.add_argument("--workers", type=int, help="decode processes of every contender (default 2)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--batches", type=int, help="batches timed per contender per round (default 30; quick 4)"
    )
    parser.add_argument(
        "--weights",
        type=parse_weights,
        help=f"of sources {','.join(NAMES)} (default {','.join(map(str, WEIGHTS))})",
    )
    parser.add_argument(
        "--cache", type=Path, default=BenchConfig().cache, help="where generated datasets are kept"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small and short: checks the path, not for quoting"
    )
    parser.add_argument("--json", type=Path, default=Path("bench-results/mixture.json"), help="results file")
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2

    def finish(results: dict[str, Any]) -> None:
        print(format_table(results, results["skipped"]), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        say(f"wrote {args.json} ({results['seconds']:.0f} s)")

    return run_benchmark(parser.prog, lambda: run(plan, args.cache), finish)


if __name__ == "__main__":
    sys.exit(main())
