"""A real training step on a GPU host, fed three ways on the same photos (issue 28).

    python -m benchmarks.gpu [--models resnet50,resnet18] [--images 20000] [--out DIR]
    python -m benchmarks.gpu --device cpu --quick        # the same code, a tiny model, on CPU

One process trains each model (AMP in bfloat16 where the card has it, else float16 with a gradient
scaler; channels_last; SGD; batch 256) on photos of ImageNet-like sizes generated on the spot, each
read with RandomResizedCrop 224 and a horizontal flip, fed:

1. synthetic: one batch made on the device and used for every step (the GPU's own limit);
2. DataLoader: ``num_workers`` = this host's cores, ``pin_memory``, persistent workers, decoding with
   the service's own OpenCV code per sample (``benchmarks.datasets.OpenCVCrops``);
3. dataferry: ``loader-service serve`` with no ``--workers`` (it sizes itself), read by
   ``ServiceLoader(device=..., decode=...)``, one row per ``--decodes``: the service decodes every
   row, a share found while it runs goes to the trainer (on CUDA, the GPU's JPEG engine), or every
   row it can send encoded does (issue 46); its workers finish starting before the trainer
   attaches, as they do for a service that runs for days.

Each feed first takes ``--warmup`` steps, then is timed for ``--seconds``, the device synchronised at
both ends. Reported per row: images/s and its fraction of (1); the *exposed wait*, the share of the
timed wall-clock the loop spent blocked getting the next batch (the same timer for every feed); the
CPU cores used by this process and its children (the DataLoader's workers; the service, which
the benchmark starts, and its workers). Before the rows, the
host-to-device copy rate of one batch from a slot of a shared-memory segment registered with CUDA
(what ``ServiceLoader`` does), from torch's own pinned memory, and from pageable memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader

from benchmarks.datasets import OpenCVCrops, single_threaded_worker
from benchmarks.module_output import say, write_results
from benchmarks.proctree import cpu_seconds, tree
from benchmarks.resnet import MODELS, make_model
from benchmarks.service_process import serving
from benchmarks.sizing import wait_booted

Batches = Generator[tuple[torch.Tensor, torch.Tensor], None, None]
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
COPY_REPEATS = 20


@dataclass(frozen=True)
class Plan:
    device: str
    models: tuple[str, ...]
    images: int
    batch: int
    image_size: int
    warmup: int
    """Steps each feed takes before its timed window (worker start-up, cuDNN's algorithm search)."""
    seconds: float
    cores: int


@dataclass
class Row:
    model: str
    feed: str
    images_per_s: float
    of_synthetic: float
    exposed_wait: float
    """Share of the timed wall-clock spent blocked on the next batch."""
    cpu_cores: float


class Trainer:
    """One model's training step: uint8 NCHW in, normalised and channels_last on the device."""

    def __init__(self, name: str, device: torch.device) -> None:
        model, self.source = make_model(name)
        self.device = device
        self.model = model.to(device).to(memory_format=torch.channels_last).train()  # type: ignore[call-overload]
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.amp_dtype: torch.dtype | None = None  # CPU: float32, this mode only checks the code runs
        if device.type == "cuda":
            self.amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        x = x.contiguous(memory_format=torch.channels_last)
        y = labels.to(self.device, non_blocking=True)
        amp = torch.autocast("cuda", self.amp_dtype) if self.amp_dtype is not None else nullcontext()
        with amp:
            loss = cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def timed(
    trainer: Trainer, batches: Batches, plan: Plan, pids: Callable[[], list[int]]
) -> tuple[float, float, float]:
    """(images/s, exposed wait share, CPU cores) over ``plan.seconds`` after ``plan.warmup`` steps."""
    for _ in range(plan.warmup):
        trainer.step(*next(batches))
    trainer.sync()
    cpu0, start = cpu_seconds(pids()), time.perf_counter()
    images, waited, now = 0, 0.0, start
    while now - start < plan.seconds:
        images_batch, labels = next(batches)
        got = time.perf_counter()
        waited += got - now
        trainer.step(images_batch, labels)
        images += len(labels)
        now = time.perf_counter()
    trainer.sync()
    wall = time.perf_counter() - start
    return images / wall, waited / wall, (cpu_seconds(pids()) - cpu0) / wall


def synthetic(plan: Plan, device: torch.device) -> Batches:
    images = torch.randint(
        0, 256, (plan.batch, 3, plan.image_size, plan.image_size), dtype=torch.uint8, device=device
    )
    labels = torch.randint(0, 1000, (plan.batch,), device=device)
    while True:
        yield images, labels


def epochs(loader: Iterable[Any]) -> Batches:
    """The loader's batches, epoch after epoch, as (images, labels)."""
    while True:
        for batch in loader:
            images, labels = batch
            yield images, labels


def own_tree() -> list[int]:
    """This process and its children: DataLoader workers, and the service with its workers."""
    return tree(os.getpid())


def feed_models(plan: Plan, device: torch.device, feed: str, batches: Batches, pids: Callable[[], list[int]],
                base: dict[str, float]) -> list[Row]:  # fmt: skip
    rows = []
    for name in plan.models:
        trainer = Trainer(name, device)
        rate, wait, cores = timed(trainer, batches, plan, pids)
        if feed == "synthetic":
            base[name] = rate
        rows.append(Row(name, feed, rate, rate / base[name], wait, cores))
        say(f"{name}, {feed}: {rate:.0f} images/s, {rate / base[name]:.2f} of synthetic, "
            f"exposed wait {wait:.0%}, {cores:.1f} CPU cores")  # fmt: skip
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def dataloader_rows(plan: Plan, device: torch.device, data: Path, base: dict[str, float]) -> list[Row]:
    loader = DataLoader(
        OpenCVCrops(data, plan.image_size),
        batch_size=plan.batch,
        shuffle=True,
        num_workers=plan.cores,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
        worker_init_fn=single_threaded_worker,
        timeout=120,
    )
    feed = f"DataLoader ({plan.cores} workers{', pin_memory' if device.type == 'cuda' else ''})"
    batches = epochs(loader)
    try:
        return feed_models(plan, device, feed, batches, own_tree, base)
    finally:
        batches.close()
        del loader  # persistent workers end with it


def service_rows(
    plan: Plan, device: torch.device, data: Path, run_dir: Path, base: dict[str, float], decode: str
) -> list[Row]:
    """The service's rows, the trainer's rows decoded as ``decode`` says (issue 46: ``service``,
    ``auto`` or ``trainer``; on CUDA the trainer's share goes to the GPU's JPEG engine)."""
    from gpu_worker import ServiceLoader
    from loader_service.tools.status_view import query_status

    args = ["--data", str(data), "--batch-size", str(plan.batch), "--image-size", str(plan.image_size)]
    args += ["--augment", "train", "--log-level", "WARNING"]
    with serving(run_dir, args) as (endpoint, _pid):
        wait_booted(endpoint, timeout=300)
        with ServiceLoader(
            endpoint, device=str(device), connect_timeout=120, timeout=120, decode=decode, decode_threads=2
        ) as loader:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            batches = epochs(loader)
            rows = feed_models(plan, device, f"dataferry, decode={decode}", batches, own_tree, base)
            batches.close()
            split = loader.stats()["decode"]
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        sizing = query_status(endpoint, 10).get("sizing") or {}
    for row in rows:
        row.feed = (
            f"dataferry, decode={decode} (share {split['share']:.2f} at the end, GPU peak {peak:.1f} GiB; "
            f"auto: {sizing.get('active')} of {sizing.get('started')} workers active)"
        )
    return rows


def copy_rates(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of one ``nbytes`` host-to-device copy: from a registered shared-memory segment, from
    torch's pinned memory, and from pageable memory. Empty where the device is not CUDA."""
    if device.type != "cuda":
        return {}
    from gpu_worker.device import CudaStager

    segment = shared_memory.SharedMemory(create=True, size=nbytes)
    stager = CudaStager(device)
    try:
        registered = torch.frombuffer(segment.buf, dtype=torch.uint8)
        stager.pin(registered.data_ptr(), nbytes)
        sources = {
            "registered slot": registered,
            "torch pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty(nbytes, dtype=torch.uint8),
        }
        rates = {name: _copy_rate(host, device) for name, host in sources.items()}
        del sources, registered
    finally:
        stager.close()
        with contextlib.suppress(BufferError):  # a view is still alive after an error: the exit frees it
            segment.close()
        segment.unlink()
    return rates


def _copy_rate(host: torch.Tensor, device: torch.device) -> float:
    target = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(COPY_REPEATS):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return COPY_REPEATS * host.numel() / (time.perf_counter() - start) / 1e9


def table(rows: list[Row], rates: dict[str, float], plan: Plan, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"{name}, {plan.cores} cores, torch {torch.__version__}; batch {plan.batch}, "
        f"{plan.image_size}px crops of {plan.images} photos, {plan.seconds:.0f} s a row",
        "",
        "| model | feed | images/s | of synthetic | exposed wait | CPU cores |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.feed} | {r.images_per_s:.0f} | {r.of_synthetic:.2f} | "
            f"{r.exposed_wait:.0%} | {r.cpu_cores:.1f} |"
        )
    if rates:
        copies = ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items())
        lines += ["", f"host-to-device copy of one batch: {copies}"]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few images, short rows")
    parser.add_argument("--models", default="", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--images", type=int, default=0, help="photos to generate (default 20000)")
    parser.add_argument("--seconds", type=float, default=0.0, help="timed seconds a row (default 25)")
    parser.add_argument("--data", default="", help="keep the photos here and reuse them on the next run")
    parser.add_argument("--out", default="", help="where gpu.json goes (default: a temporary folder)")
    parser.add_argument(
        "--decodes", default="service,auto,trainer", help="the service's rows, one per ServiceLoader decode="
    )
    args = parser.parse_args(argv)
    quick = args.quick
    models = tuple(m for m in args.models.split(",") if m) or (
        ("tiny",) if quick else ("resnet50", "resnet18")
    )
    plan = Plan(
        device=args.device,
        models=models,
        images=args.images or (256 if quick else 20_000),
        batch=32 if quick else 256,
        image_size=64 if quick else 224,
        warmup=2 if quick else 15,
        seconds=args.seconds or (2.0 if quick else 25.0),
        cores=len(os.sched_getaffinity(0)),
    )
    return plan, args


def main(argv: list[str] | None = None) -> int:
    plan, args = parse(argv)
    device = torch.device(plan.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        say("no CUDA device here: run with --device cpu (and --quick) to check the code on CPU")
        return 2
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    from loader_service.tools.sample_data import make_sample_dataset, progress_printer

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-gpu-")))
        data = Path(args.data) if args.data else work / "data"
        classes = 100 if plan.images >= 1000 else 4
        say(f"photos: {plan.images} in {data}")
        make_sample_dataset(data, classes=classes, per_class=plan.images // classes, seed=28,
                            progress=progress_printer("photos"), processes=plan.cores)  # fmt: skip
        run_dir = work / "run"
        run_dir.mkdir()
        rates = copy_rates(device, plan.batch * 3 * plan.image_size**2)
        base: dict[str, float] = {}
        rows = feed_models(plan, device, "synthetic", synthetic(plan, device), own_tree, base)
        rows += dataloader_rows(plan, device, data, base)
        for decode in args.decodes.split(","):
            rows += service_rows(plan, device, data, run_dir, base, decode)
    text = table(rows, rates, plan, device)
    say("")
    say(text)
    record = {"plan": asdict(plan), "rows": [asdict(r) for r in rows], "copy_gb_per_s": rates, "table": text}
    write_results(args.out, "gpu", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
