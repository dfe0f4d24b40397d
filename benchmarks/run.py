"""One benchmark run: the selected scenarios, in an order that lets them share processes.

NOTE [ Scenario order ]
    1. The DataLoader contenders start their workers first, while this process has no ZeroMQ
       threads yet (DataLoader forks its workers): DataLoader+OpenCV at every filter of (a), then
       DataLoader+PIL, then (k)'s two eval DataLoaders.
    2. Service A (batch 64) starts with one feed per filter and an eval feed (NOTE [ One feed per
       filter ]); a ServiceLoader attaches to each feed used; the decode limits run in this process.
    3. (a)+(f) share their timed segments; then (k), (d), (c) warm and cold, (e) at batch 64, (g),
       all on service A.
    4. Every contender of this process is closed, so that (b)'s eight trainers are alone with the
       service (an idle trainer attached here would hold slots of its pool).
    5. Service A is stopped and must exit 0; (e) at batch 256 runs on service B and a DataLoader of 256.
    6. (h) on a service of its own running the user pipeline: its DataLoader first, then its
       ServiceLoader; every contender closed before (h)'s group of trainers, as for (b). Then (i) on
       two services of their own (tar shards, files), both read by this process in turn.
    7. (j) last, on services of its own: a CURVE service on loopback TCP serves the remote and the
       local trainer; then plain-TCP and ipc services join it for the transport alone. Nothing else
       runs meanwhile, so no idle DataLoader or service of an earlier step sits in its way.
    Processes are released through ExitStacks, in reverse order of creation (streams, then loaders,
    then the service), on success and failure alike (NOTE [ Benchmark service lifecycle ]).

NOTE [ One feed per filter ]
    (a) times the service at several resize filters in the same interleaved rounds, so one service
    holds them all: its first feed (``train``, the flags) runs the main filter (the first of
    ``--interpolations``), and a config file adds a ``[feeds.train-FILTER]`` table per other filter
    and, for (k), ``[feeds.eval]`` (``augment = "eval"``, the main filter); every table names the same
    data and inherits batch, size and seed from the flags. Each trainer picks its feed by name. The
    feeds share the decode workers and each has its own pool, so a feed's idle trainer (its credits
    full) takes no worker from the one being timed. Every scenario but (a), (f) and (k) uses the first
    feed only, as a single-feed service would serve it; (g)'s shared memory counts every feed's pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import cv2

from benchmarks.config import SCENARIO_TITLES, BenchConfig
from benchmarks.contenders import Contender, decode_limit_stream, loader_stream
from benchmarks.datasets import (
    DataSpec,
    OpenCVCrops,
    PILCrops,
    PipelineSamples,
    PlainEval,
    make_dataloader,
    make_pipeline_dataloader,
    make_saved,
    make_shards,
    make_tfrecords,
    make_zip,
    prepare_data,
    saved_path,
    shards_folder,
    tfrecord_path,
    zip_path,
)
from benchmarks.machine import machine_facts
from benchmarks.pipelines import H_PIPELINE, measure_identical, pipeline_spec, torchvision_problem
from benchmarks.proctree import service_segments
from benchmarks.progress import LazyProgress, say
from benchmarks.remote import (
    CurveFiles,
    Timed,
    Transport,
    make_curve_files,
    measure_remote_rate,
    measure_transport,
)
from benchmarks.results import (
    DECODE_LIMIT,
    DL_OPENCV,
    DL_PIL,
    DL_PIPELINE,
    DL_USER,
    FAR_LATENCY,
    FILES,
    LOCAL_SHM,
    REMOTE_CURVE,
    REMOTE_FAR,
    REMOTE_PLAIN,
    SAVED_ARROW,
    SERVICE,
    SHM,
    TAR_SHARDS,
    TCP_CURVE,
    TCP_PLAIN,
    TFRECORDS,
    ZIP_ARCHIVE,
    ZIP_STORED,
    ZMQ_CURVE,
    ZMQ_PLAIN,
    BenchResults,
    Measurement,
    Timeline,
)
from benchmarks.scenarios import (
    fill_seconds,
    first_batch_dataloader,
    first_batch_service,
    interleaved_rounds,
    measure_memory,
    measure_overlap,
    measure_rates,
    measure_throughput,
    ready_costs,
    time_segment,
)
from benchmarks.service_process import BenchError, ServiceProcess, ServiceSpec, running_service
from benchmarks.stats import rate
from benchmarks.trainers import TrainerConfig, measure_trainers
from benchmarks.wire import RawPair, loopback_endpoint
from gpu_worker import ServiceLoader
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.decoders import describe_decoder
from loader_service.decode.transforms import Recipe
from testkit.netfaults import proxy_process

SERVICE_CREDITS = 6
"""ServiceLoader's default: also how many batches may wait for it after it idled."""
DATALOADER_PREFETCH = 2
"""DataLoader's default ``prefetch_factor``: batches per worker that may wait after it idled."""
TRANSPORT_SPARE_SLOTS = 4
"""(j): pool slots beyond one transfer's batches: the warm start's two, and room to spare."""
B_LOADER_KWARGS: dict[str, Any] = {"mode": "broadcast", "group": "bench", "group_size": 4}
"""(b)'s extra ServiceLoader arguments: the four trainers form one broadcast group, so each image
is decoded once for all four (docs/trainers.md: "Several trainers on one service")."""
H_GROUP = "bench-pipeline"
"""(h)'s broadcast group (B_LOADER_KWARGS otherwise)."""
MAIN_FEED = "train"
"""The service's first feed (its default ``--feed``), at the run's main filter."""
EVAL_FEED = "eval"
"""(k)'s feed on service A (NOTE [ One feed per filter ])."""


def filter_feed(interpolation: str) -> str:
    """The feed of service A that runs the train transform at another filter than the main one."""
    return f"{MAIN_FEED}-{interpolation}"


def feeds_toml(data: Path, main: str, others: Sequence[str], eval_feed: bool) -> str:
    """Service A's config file: a ``[feeds.NAME]`` table per filter of ``others`` (the flags' feed
    runs ``main``), and the eval feed at ``main`` if asked (NOTE [ One feed per filter ])."""
    tables = [(filter_feed(f), "train", f) for f in others]
    if eval_feed:
        tables.append((EVAL_FEED, "eval", main))
    lines = []
    for name, augment, interpolation in tables:
        lines += [
            f"[feeds.{json.dumps(name)}]",
            f"data = {json.dumps(str(data))}",  # a JSON string is a TOML basic string
            f"augment = {json.dumps(augment)}",
            f"interpolation = {json.dumps(interpolation)}",
            "",
        ]
    return "\n".join(lines)


class BenchRun:
    """State of one run: config, data, scratch directory, and what has been measured so far."""

    def __init__(self, cfg: BenchConfig, data: DataSpec, run_dir: Path) -> None:
        self.cfg = cfg
        self.data = data
        self.run_dir = run_dir
        self.measurements: list[Measurement] = []
        self.timelines: dict[str, Timeline] = {}
        self.services: list[ServiceProcess] = []
        self.contenders: dict[str, Contender] = {}
        """The main filter's contenders by key, for (d), (e) and (g)."""
        self.throughput_timed: list[tuple[Contender, str]] = []
        """(a), (f): every contender with the filter it runs ("": timed once for all filters)."""
        self.eval_timed: list[Contender] = []
        """(k)'s contenders."""
        self.skipped: dict[str, str] = {}

    # --- processes ------------------------------------------------------------------------------

    def batches_per_epoch(self, batch_size: int) -> int:
        return -(-self.data.images // batch_size)

    def start_service(
        self,
        stack: contextlib.ExitStack,
        name: str,
        batch_size: int,
        endpoint: str = "",
        extra_args: tuple[str, ...] = (),
        data: Path | None = None,
    ) -> ServiceProcess:
        """A service on ``endpoint`` (default: an ipc socket in the scratch directory), reading ``data``
        (default: the run's dataset)."""
        cfg = self.cfg
        spec = ServiceSpec(
            data or self.data.root,
            endpoint or f"ipc://{self.run_dir}/{name}.sock",
            cfg.workers,
            batch_size,
            cfg.image_size,
            seed=cfg.seed,
            extra_args=("--decoder", cfg.decoder, "--interpolation", cfg.interpolation, *extra_args),
        )
        scheme = spec.endpoint.split(":")[0]
        say(f"starting service {name}: {cfg.workers} workers, batch {batch_size}, {scheme}")
        service = stack.enter_context(running_service(spec, self.run_dir / f"{name}.log"))
        self.services.append(service)
        return service

    def crops(self, augment: str = "train", interpolation: str = "") -> OpenCVCrops:
        """The service's transform in a DataLoader's Dataset; default: train at the main filter."""
        return OpenCVCrops(
            self.data.root, self.cfg.image_size, Recipe(augment, interpolation or self.cfg.interpolation)
        )

    def dataloader_contender(
        self,
        stack: contextlib.ExitStack,
        key: str,
        batch_size: int,
        dataset: OpenCVCrops | PILCrops | PlainEval | None = None,
    ) -> Contender:
        """A DataLoader with persistent workers, started now (its first batch is taken here); its
        dataset: ``dataset``, else the one ``key`` names at the main filter."""
        cfg = self.cfg
        if dataset is None:
            dataset = self.crops() if key == DL_OPENCV else PILCrops(self.data.root, cfg.image_size)
        stream = loader_stream(make_dataloader(dataset, cfg.workers, batch_size, cfg.timeout))
        contender = Contender(key, stream, DATALOADER_PREFETCH * cfg.workers, cfg.warmup_batches)
        stack.callback(contender.close)
        contender.pull()
        return contender

    def loader(
        self,
        stack: contextlib.ExitStack,
        service: ServiceProcess,
        credits: int = SERVICE_CREDITS,
        transport: str = "auto",
        curve: CurveFiles | None = None,
        feed: str = "",
        endpoint: str = "",
    ) -> ServiceLoader:
        """A ServiceLoader on ``service`` (its ``feed``: default the first), closed with ``stack``;
        ``curve``: the keys to present; ``endpoint``: where to reach it, if not its own (a proxy)."""
        server_key, client_key = curve.client() if curve else (None, None)
        loader = ServiceLoader(
            endpoint or service.spec.endpoint,
            device="cpu",
            feed=feed,
            timeout=self.cfg.timeout,
            credits=credits,
            transport=transport,
            server_key=server_key,
            client_key=client_key,
        )
        stack.callback(loader.close)
        return loader

    def service_contender(
        self,
        stack: contextlib.ExitStack,
        service: ServiceProcess,
        key: str = SERVICE,
        transport: str = "auto",
        curve: CurveFiles | None = None,
        feed: str = "",
        endpoint: str = "",
    ) -> Contender:
        """A ServiceLoader read as (a) reads it, with (a)'s credits."""
        loader = self.loader(stack, service, SERVICE_CREDITS, transport, curve, feed, endpoint)
        stream = loader_stream(loader)
        contender = Contender(key, stream, SERVICE_CREDITS, self.cfg.warmup_batches)
        stack.callback(contender.close)  # runs first: the stream ends before its loader closes
        return contender

    def decode_limit_contender(self, interpolation: str = "") -> Contender:
        """The service's per-image work at ``interpolation`` (default: the main filter), one process."""
        cfg = self.cfg
        recipe = Recipe("train", interpolation or cfg.interpolation, cfg.roi)
        stream = decode_limit_stream(self.crops().index, cfg.batch_size, cfg.image_size, cfg.seed, recipe)
        return Contender(DECODE_LIMIT, stream, backlog=0, warmup=1, scale=cfg.workers)

    # --- phases (NOTE [ Scenario order ]) -------------------------------------------------------

    def setup(self, stack: contextlib.ExitStack, service: ServiceProcess) -> None:
        """Contenders the batch-64 scenarios need, every DataLoader first."""
        cfg = self.cfg
        main, *others = cfg.interpolations
        timing = cfg.wants("a", "f")
        if cfg.wants("a", "f", "d", "e"):
            self.contenders[DL_OPENCV] = self.dataloader_contender(stack, DL_OPENCV, cfg.batch_size)
        other_dls = {
            f: self.dataloader_contender(stack, DL_OPENCV, cfg.batch_size, self.crops(interpolation=f))
            for f in (others if timing else ())
        }
        pil = self.dataloader_contender(stack, DL_PIL, cfg.batch_size) if timing else None
        if cfg.wants("k"):
            self.eval_timed = [
                self.dataloader_contender(stack, DL_OPENCV, cfg.batch_size, self.crops("eval")),
                self.dataloader_contender(
                    stack, DL_USER, cfg.batch_size, PlainEval(self.data.root, cfg.image_size)
                ),
            ]
        # No DataLoader below this line: ServiceLoaders start ZeroMQ threads (NOTE [ Scenario order ]).
        if cfg.wants("a", "f", "d", "e", "g"):
            self.contenders[SERVICE] = self.service_contender(stack, service)
        if cfg.wants("k"):
            self.eval_timed.insert(0, self.service_contender(stack, service, feed=EVAL_FEED))
        if pil is None:
            return
        self.throughput_timed = [
            (self.contenders[SERVICE], main),
            (self.contenders[DL_OPENCV], main),
            (pil, ""),
            (self.decode_limit_contender(), main),
        ]
        for f in others:  # each filter's contenders side by side, so a round times them close in time
            self.throughput_timed += [
                (self.service_contender(stack, service, feed=filter_feed(f)), f),
                (other_dls[f], f),
                (self.decode_limit_contender(f), f),
            ]

    def service_a_config(self) -> tuple[str, ...]:
        """Service A's ``--config``, when it needs feeds beyond its first (NOTE [ One feed per filter ])."""
        cfg = self.cfg
        others = cfg.interpolations[1:] if cfg.wants("a", "f") else ()
        if not others and not cfg.wants("k"):
            return ()
        path = self.run_dir / "feeds.toml"
        path.write_text(feeds_toml(self.data.root, cfg.interpolation, others, cfg.wants("k")))
        return ("--config", str(path))

    def throughput(self) -> None:
        say(f"(a, f) {SCENARIO_TITLES['a']}; {SCENARIO_TITLES['f']}: {', '.join(self.cfg.interpolations)}")
        measured, timelines = measure_throughput(
            self.throughput_timed, self.cfg.interpolations, self.cfg.rounds, self.cfg.timed_batches
        )
        self.measurements += [m for m in measured if self.cfg.wants(m.scenario)]
        self.timelines.update(timelines)

    def eval_rates(self) -> None:
        """(k): the eval feed against the DataLoaders running the same eval transform and a user's."""
        cfg = self.cfg
        say(f"(k) {SCENARIO_TITLES['k']}")
        rates, cpu, timelines = measure_rates(
            self.eval_timed, cfg.rounds, cfg.timed_batches, "k", "eval feed, one trainer"
        )
        self.measurements += [dataclasses.replace(m, variant=cfg.interpolation) for m in (rates, cpu)]
        self.timelines.update({f"k:{k}": t for k, t in timelines.items()})

    def load_per_batch(self, key: str) -> float:
        """Seconds to load one batch: from (a) when it ran, else from one timed segment now."""
        a = next((m for m in self.measurements if m.key == "a"), None)
        images_per_second = a.median(key) if a else None
        if images_per_second is None:
            segment = time_segment(self.contenders[key], self.cfg.timed_batches)
            images_per_second = rate(segment.images, segment.seconds)
        return self.cfg.batch_size / images_per_second

    def overlap(self) -> None:
        say(f"(d) {SCENARIO_TITLES['d']}")
        keys = (SERVICE, DL_OPENCV)
        loads = {k: self.load_per_batch(k) for k in keys}
        d, timelines = measure_overlap(
            [self.contenders[k] for k in keys],
            loads,
            loads[SERVICE],
            self.cfg.overlap_epochs,
            self.batches_per_epoch(self.cfg.batch_size),
        )
        self.measurements.append(d)
        self.timelines.update({f"d:{k}": t for k, t in timelines.items()})

    def first_batch(self, service: ServiceProcess) -> None:
        say(f"(c) {SCENARIO_TITLES['c']}")
        cfg = self.cfg
        endpoint = service.spec.endpoint
        samples = {
            SERVICE: first_batch_service(endpoint, cfg.first_batch_repeats, cfg.timeout),
            DL_OPENCV: first_batch_dataloader(
                self.crops(),
                cfg.workers,
                cfg.batch_size,
                max(2, cfg.first_batch_repeats // 2),
                cfg.timeout,
            ),
        }
        self.measurements.append(Measurement("c", "c", "construct to first batch", "s", samples))
        cold = first_batch_service(endpoint, cfg.first_batch_repeats, cfg.timeout, cold=True)
        notes = {"batch_size": float(cfg.batch_size), "workers": float(cfg.workers)}
        title = "construct to first batch, nothing decoded for its plan, every worker idle"
        self.measurements.append(Measurement("c", "c-cold", title, "s", {SERVICE: cold}, notes=notes))

    def per_image_seconds(self) -> float:
        """One process's seconds per image of the pipeline: from (a)'s decode limit, else timed now."""
        a = next((m for m in self.measurements if m.key == "a"), None)
        limit = a.median(DECODE_LIMIT) if a else None
        if limit:
            return self.cfg.workers / limit
        segment = time_segment(self.decode_limit_contender(), 1)
        return segment.seconds / max(1, segment.images)

    def costs(self, batch_size: int, service: Contender, dataloader: Contender) -> None:
        cfg = self.cfg
        say(f"(e) {SCENARIO_TITLES['e']}, batch {batch_size}")
        bpe = self.batches_per_epoch(batch_size)
        per_image = self.per_image_seconds()
        samples = {}
        for contender, most in (
            (service, SERVICE_CREDITS - 1),
            (dataloader, DATALOADER_PREFETCH * cfg.workers - 1),
        ):
            ready = min(most, bpe - 1)
            fill = fill_seconds(ready, cfg.workers, batch_size, per_image)
            samples[contender.key] = ready_costs(contender, ready, fill, cfg.cost_epochs, bpe, batch_size)
        notes = {"batch_size": float(batch_size)}
        self.measurements.append(
            Measurement("e", f"e{batch_size}", "next() on a ready batch", "us", samples, notes=notes)
        )

    def memory(self, service: ServiceProcess) -> None:
        say(f"(g) {SCENARIO_TITLES['g']}")
        bpe = self.batches_per_epoch(self.cfg.batch_size)
        self.measurements.append(
            measure_memory(self.contenders[SERVICE], service.pid, self.cfg.memory_epochs, bpe)
        )

    def trainer_base(self, pipeline: str = "", seed: int = 0) -> TrainerConfig:
        """What every trainer process of (b) and (h)'s group shares; each gets its own index."""
        cfg = self.cfg
        return TrainerConfig(
            0,
            "",
            self.data.root,
            cfg.workers,
            cfg.batch_size,
            cfg.image_size,
            cfg.warmup_batches,
            cfg.trainer_batches,
            cfg.timeout,
            pipeline=pipeline,
            seed=seed,
        )

    def trainers(self, service: ServiceProcess) -> None:
        cfg = self.cfg
        say(f"(b) {SCENARIO_TITLES['b']}: {cfg.trainers} ServiceLoaders, then {cfg.trainers} DataLoaders")
        base = self.trainer_base()
        kwargs = {**B_LOADER_KWARGS, "group_size": cfg.trainers}
        self.measurements.append(measure_trainers(base, cfg.trainers, service.spec.endpoint, kwargs))

    def large_batch_costs(self) -> None:
        """(e) at every batch size but the run's own, each on a service and a DataLoader of that size."""
        for batch_size in (b for b in self.cfg.cost_batch_sizes if b != self.cfg.batch_size):
            with contextlib.ExitStack() as stack:
                service = self.start_service(stack, f"batch{batch_size}", batch_size)
                dataloader = self.dataloader_contender(stack, DL_OPENCV, batch_size)
                self.costs(batch_size, self.service_contender(stack, service), dataloader)

    def with_service_a(self) -> None:
        """Every scenario at the run's batch size, on one service (stopped when this returns)."""
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            name = f"batch{cfg.batch_size}"
            service = self.start_service(stack, name, cfg.batch_size, extra_args=self.service_a_config())
            with contextlib.ExitStack() as contenders:
                self.setup(contenders, service)
                self.on_contenders(service)
            self.contenders.clear()
            self.throughput_timed.clear()
            self.eval_timed.clear()
            if cfg.wants("b"):
                self.trainers(service)

    def on_contenders(self, service: ServiceProcess) -> None:
        cfg = self.cfg
        if cfg.wants("a", "f"):
            self.throughput()
        if cfg.wants("k"):
            self.eval_rates()
        if cfg.wants("d"):
            self.overlap()
        if cfg.wants("c"):
            self.first_batch(service)
        if cfg.wants("e") and cfg.batch_size in cfg.cost_batch_sizes:
            self.costs(cfg.batch_size, self.contenders[SERVICE], self.contenders[DL_OPENCV])
        if cfg.wants("g"):
            self.memory(service)

    def remote_rate(self, service: ServiceProcess, plain: ServiceProcess, curve: CurveFiles) -> None:
        """(j) with decoding: the remote and the local trainer attached together, timed in turn, and
        a remote trainer of a plain-TCP service (what CURVE costs), timed in the same rounds."""
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            remote = self.service_contender(stack, service, REMOTE_CURVE, transport="tcp", curve=curve)
            clear = self.service_contender(stack, plain, REMOTE_PLAIN, transport="tcp")
            local = self.service_contender(stack, service, LOCAL_SHM, transport="shm", curve=curve)
            contenders = [remote, clear, local]
            measured, timelines = measure_remote_rate(contenders, cfg.rounds, cfg.timed_batches)
        self.measurements += measured
        self.timelines.update({f"j:{k}": t for k, t in timelines.items()})

    def far_rate(self, service: ServiceProcess, curve: CurveFiles) -> None:
        """(l): the remote trainer through a proxy that delays every byte 50 ms each way, against the
        same trainer without it, timed in turn; both with the loader's default credits."""
        cfg = self.cfg
        say(f"(l) {SCENARIO_TITLES['l']}")
        with contextlib.ExitStack() as stack:
            host, port = service.spec.endpoint[len("tcp://") :].rsplit(":", 1)
            proxy = stack.enter_context(proxy_process((host, int(port)), FAR_LATENCY))
            far = self.service_contender(stack, service, REMOTE_FAR, "tcp", curve, endpoint=proxy)
            near = self.service_contender(stack, service, REMOTE_CURVE, transport="tcp", curve=curve)
            got = interleaved_rounds(
                [far, near], cfg.rounds, cfg.timed_batches, "(l) far and near trainer rounds"
            )
        title = "remote trainer (TCP+CURVE) through a 50 ms proxy and without it, on one service"
        notes = {"credits": float(SERVICE_CREDITS), "latency_ms": FAR_LATENCY * 1000}
        self.measurements.append(
            Measurement("l", "l-rate", title, "images/s", got.rates, paired=True, notes=notes)
        )
        self.timelines.update({f"l:{k}": t for k, t in got.timelines.items()})

    def remote(self) -> None:
        """(j) and (l), step 7 of NOTE [ Scenario order ]; the services' pools hold one transfer's
        batches."""
        cfg = self.cfg
        count = min(cfg.transport_batches, self.batches_per_epoch(cfg.batch_size))
        slots = ("--slots", str(count + TRANSPORT_SPARE_SLOTS))
        curve = make_curve_files(self.run_dir / "keys")
        with contextlib.ExitStack() as stack:
            curve_args = (*slots, *curve.service_args())
            secure = self.start_service(stack, "curve", cfg.batch_size, loopback_endpoint(), curve_args)
            if cfg.wants("l"):
                self.far_rate(secure, curve)
            if not cfg.wants("j"):
                return
            say(f"(j) {SCENARIO_TITLES['j']}")
            plain_args = (*slots, "--insecure-tcp")  # loopback, yet every tcp:// needs CURVE or this
            plain = self.start_service(stack, "tcp", cfg.batch_size, loopback_endpoint(), plain_args)
            self.remote_rate(secure, plain, curve)
            local = self.start_service(stack, "shm", cfg.batch_size, extra_args=slots)
            timed: list[Timed] = [
                Transport(TCP_CURVE, self.loader(stack, secure, count, "tcp", curve), secure, curve.client()),
                Transport(TCP_PLAIN, self.loader(stack, plain, count, "tcp"), plain, (None, None)),
                Transport(SHM, self.loader(stack, local, count, "shm"), local, (None, None)),
                *self.raw_pairs(stack, curve),
            ]
            self.measurements += measure_transport(timed, cfg.rounds, count)

    def raw_pairs(self, stack: contextlib.ExitStack, curve: CurveFiles) -> list[RawPair]:
        """(j)'s reference: pyzmq alone, frames the size of one batch's images, CURVE and plain."""
        frame = self.cfg.batch_size * 3 * self.cfg.image_size**2
        pairs = []
        for key, keys in ((ZMQ_CURVE, (curve.service_secret, curve.trainer_secret)), (ZMQ_PLAIN, None)):
            pairs.append(RawPair(key, frame, self.cfg.timeout, keys))
            stack.callback(pairs[-1].close)  # at once: a later pair that fails must not strand this one
        return pairs

    def pipeline_rates(self, service: ServiceProcess, dataset: PipelineSamples) -> None:
        """(h) one trainer: the service against a DataLoader running the same function, alternately,
        after checking that both make the same samples."""
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            loader = make_pipeline_dataloader(dataset, cfg.workers, cfg.batch_size, cfg.timeout)
            dataloader = Contender(
                DL_PIPELINE, loader_stream(loader), DATALOADER_PREFETCH * cfg.workers, cfg.warmup_batches
            )
            stack.callback(dataloader.close)
            dataloader.pull()  # its workers start (fork) before this process attaches a trainer
            served = self.service_contender(stack, service)
            identical = measure_identical(service.spec.endpoint, dataset, cfg.timeout)
            rates, cpu, timelines = measure_rates(
                [served, dataloader], cfg.rounds, cfg.timed_batches, "h", "pipeline, one trainer"
            )
        self.measurements += [rates, cpu, identical]
        self.timelines.update({f"h:{k}": t for k, t in timelines.items()})

    def pipeline_group(self, service: ServiceProcess, pipeline: str) -> None:
        """(h) group: trainers in one broadcast group against as many DataLoaders running the pipeline."""
        cfg = self.cfg
        say(f"(h) {cfg.trainers} ServiceLoaders in a broadcast group, then {cfg.trainers} DataLoaders")
        base = self.trainer_base(pipeline=pipeline, seed=cfg.seed)
        kwargs = {**B_LOADER_KWARGS, "group": H_GROUP, "group_size": cfg.trainers}
        endpoint = service.spec.endpoint
        self.measurements.append(
            measure_trainers(base, cfg.trainers, endpoint, kwargs, key="h-group", other=DL_PIPELINE)
        )

    def with_pipeline(self) -> None:
        """(h), step 6 of NOTE [ Scenario order ]: a service running the pipeline instead of --augment."""
        say(f"(h) {SCENARIO_TITLES['h']}: {H_PIPELINE}")
        pipeline = pipeline_spec()
        with contextlib.ExitStack() as stack:
            service = self.start_service(
                stack, "pipeline", self.cfg.batch_size, extra_args=("--pipeline", pipeline)
            )
            self.pipeline_rates(service, PipelineSamples(self.data.root, pipeline, self.cfg.seed))
            self.pipeline_group(service, pipeline)

    def made(self, what: str, folder: Path, make: Callable[[DatasetIndex, Path], Path], kind: str) -> Path:
        """(i)'s ``what``: the run's dataset as ``kind`` in ``folder`` (made once, then reused),
        checked against it (same count, labels and order)."""
        index = build_index(self.data.root)
        say(f"(i) {what} of the {len(index)} images: {folder.name} in the cache")
        data = make(index, folder)
        check_same_samples(index, build_index(data, kind))
        return data

    def with_shards(self) -> None:
        """(i), step 6 of NOTE [ Scenario order ]: one service on the shards, one on each zip
        archive (deflated, stored), one on the files, one trainer each, timed in turn."""
        cfg, root = self.cfg, self.data.root
        formats = [
            ("tar", TAR_SHARDS, self.made("tar shards", shards_folder(cfg, root), make_shards, "tar")),
            ("zip", ZIP_ARCHIVE, self.made("a deflated zip archive", zip_path(cfg, root), make_zip, "zip")),
            ("zip", ZIP_STORED, self.made("a stored zip archive", zip_path(cfg, root, stored=True),
                                          functools.partial(make_zip, stored=True), "zip")),
        ]  # fmt: skip
        if installed("datasets", "save_to_disk folder"):
            saved = self.made("a save_to_disk folder", saved_path(cfg, root), make_saved, "arrow")
            formats.append(("arrow", SAVED_ARROW, saved))
        if installed("tfrecord", "TFRecord files"):
            tfrecords = self.made("TFRecord files", tfrecord_path(cfg, root), make_tfrecords, "tfrecord")
            formats.append(("tfrecord", TFRECORDS, tfrecords))
        say(f"(i) {SCENARIO_TITLES['i']}")
        with contextlib.ExitStack() as stack:
            batch = cfg.batch_size
            services = [
                (self.start_service(stack, key, batch, extra_args=("--format", kind), data=data), key)
                for kind, key, data in formats
            ]
            files = self.start_service(stack, "files", cfg.batch_size)
            with contextlib.ExitStack() as contenders:
                timed = [
                    *(self.service_contender(contenders, service, key) for service, key in services),
                    self.service_contender(contenders, files, FILES),
                ]
                rates, cpu, timelines = measure_rates(
                    timed, cfg.rounds, cfg.timed_batches, "i", "formats against files"
                )
        self.measurements += [rates, cpu]
        self.timelines.update({f"i:{k}": t for k, t in timelines.items()})

    def check_scenarios(self) -> None:
        """Before anything runs: scenarios this run cannot do, and why, said at once."""
        if self.cfg.wants("h") and (problem := torchvision_problem()):
            self.skipped["h"] = problem
            say(f"(h) skipped: {problem}")

    def run_all(self) -> None:
        cv2.setNumThreads(1)  # this process only ever does single-process work (the decode limit)
        self.check_scenarios()
        if self.cfg.wants("a", "b", "c", "d", "e", "f", "g", "k"):
            self.with_service_a()
        if self.cfg.wants("e"):
            self.large_batch_costs()
        if self.cfg.wants("h") and "h" not in self.skipped:
            self.with_pipeline()
        if self.cfg.wants("i"):
            self.with_shards()
        if self.cfg.wants("j", "l"):
            self.remote()


def check_same_samples(files: DatasetIndex, shards: DatasetIndex) -> None:
    """(i) compares two sources of the same samples: the same count and labels, in the same order."""
    if len(files) != len(shards) or not (files.labels == shards.labels).all():
        raise BenchError(
            f"the tar shards hold {len(shards)} samples for {len(files)} files, or other labels: "
            "remove the shard folder from the cache and run again"
        )


def settings(cfg: BenchConfig, data: DataSpec) -> dict[str, Any]:
    """The configuration as reported: every knob, no path of this machine."""
    values = asdict(cfg)
    for key in ("data", "cache", "json_path", "plot_path", "markdown_path"):
        values.pop(key)
    values["scenarios"] = "".join(cfg.scenarios)
    values["cost_batch_sizes"] = list(cfg.cost_batch_sizes)
    values["interpolations"] = list(cfg.interpolations)
    values["data"] = data.public()
    values["decoder_used"] = describe_decoder(cfg.decoder)
    values["pipeline"] = H_PIPELINE
    return values


def cleanup_report(services: list[ServiceProcess]) -> dict[str, Any]:
    return {
        "service_exit_codes": [s.exit_code for s in services],
        "segments_left": sum(len(service_segments(s.pid)) for s in services),
    }


def run(cfg: BenchConfig) -> BenchResults:
    """Prepare data, run every selected scenario, and gather the results (processes all stopped)."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    begin = time.monotonic()
    generation = LazyProgress("generating the sample dataset")
    data = prepare_data(cfg, progress=generation)
    generation.close()
    say(data.describe())
    with tempfile.TemporaryDirectory(prefix="dataferry-bench-") as scratch:
        bench = BenchRun(cfg, data, Path(scratch))
        bench.run_all()
    return BenchResults(
        settings=settings(cfg, data),
        machine=machine_facts(),
        measurements=tuple(bench.measurements),
        timelines=bench.timelines,
        cleanup=cleanup_report(bench.services),
        started=started,
        seconds=time.monotonic() - begin,
        skipped=bench.skipped,
    )


def installed(package: str, what: str) -> bool:
    """Whether ``package`` (which writes (i)'s ``what``) can be imported; said when it cannot."""
    if importlib.util.find_spec(package) is None:
        say(f"(i) no {what}: the {package} package is not installed")
        return False
    return True
