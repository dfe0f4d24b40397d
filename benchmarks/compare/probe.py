"""One scenario of ``python -m benchmarks.compare``, run under one revision's code: prints one JSON line.

This file is copied out of the tree and run as a script with the revision's environment, so that the
same measuring code times every revision: it imports only the standard library, numpy, OpenCV, torch,
pyzmq, psutil-free /proc reads and the product's public surface (``gpu_worker.ServiceLoader`` and the
``loader_service serve`` command line), which every revision compared has. What differs between two
runs is therefore the product alone.

    python probe.py SCENARIO --data DIR --work DIR [--quick] [--workers N]

The line printed last is ``{"scenario": ..., "value": ..., "unit": ..., "higher_is_better": ...,
"detail": {...}}``; a scenario a revision cannot run prints ``{"scenario": ..., "error": "..."}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 32
SIZE = 224
READY_TIMEOUT = 120.0
SLEEPY = """
import os, time
import numpy as np

def sleepy(sample, rng):
    time.sleep(float(os.environ.get("PROBE_SAMPLE_SECONDS", "0.01")))
    return {"image": np.zeros((3, 16, 16), dtype=np.uint8), "label": np.int64(sample["label"])}
"""
"""The waiting-bound pipeline: a sleep per sample, standing for slow storage (ramp, straggler)."""


# --- the service, as a user starts it ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def service(
    work: Path, data: Path, flags: list[str], endpoint: str = "", env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``loader_service serve`` in its own process group, ready (its endpoint answers) when yielded."""
    # In the system's temp folder, not ``work``: an ipc path may not be longer than 107 characters.
    endpoint = endpoint or f"ipc://{tempfile.mkdtemp(prefix='dataferry-probe-')}/s.sock"
    log = open(work / f"service-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 - closed below
    command = [sys.executable, "-m", "loader_service", "serve"]
    command += ["--data", str(data), "--endpoint", endpoint, *flags]
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_ready(proc, Path(log.name))
        yield endpoint, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        if endpoint.startswith("ipc://"):
            shutil.rmtree(os.path.dirname(endpoint[len("ipc://") :]), ignore_errors=True)


def wait_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if " ready: " in log.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the service was not ready within {READY_TIMEOUT:.0f} s")


def loader(endpoint: str | list[str], **kwargs: Any) -> Any:
    from gpu_worker import ServiceLoader

    return ServiceLoader(endpoint, timeout=120, connect_timeout=60, **kwargs)


def epoch_rate(batches: Iterator[Any], skip: int = 2) -> float:
    """Images a second over an epoch, the first ``skip`` batches (the pipeline filling) left out."""
    images, start = 0, 0.0
    for i, batch in enumerate(batches):
        rows = len(batch.indices) if hasattr(batch, "indices") else _rows(batch)
        if i == skip:
            start = time.perf_counter()
        elif i > skip:
            images += rows
    return images / (time.perf_counter() - start)


def _rows(batch: Any) -> int:
    """Rows of a DataLoader batch: a (images, labels) pair, or a dict of fields (a pipeline's)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(first)


# --- DataLoader doing the same work --------------------------------------------------------------


def files_of(data: Path) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in data.iterdir() if p.is_dir())
    return [(str(f), label) for label, c in enumerate(classes) for f in sorted((data / c).iterdir())]


def read_rgb(path: str) -> np.ndarray:
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError(f"cannot decode {path}")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def random_resized_crop(image: np.ndarray, rng: random.Random) -> np.ndarray:
    """torchvision's RandomResizedCrop sampling (scale 0.08-1, ratio 3/4-4/3), then a flip at p=0.5."""
    h, w = image.shape[:2]
    for _ in range(10):
        area = h * w * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = round((area * ratio) ** 0.5), round((area / ratio) ** 0.5)
        if 0 < cw <= w and 0 < ch <= h:
            y, x = rng.randint(0, h - ch), rng.randint(0, w - cw)
            break
    else:
        ch, cw, y, x = h, w, 0, 0
    out = cv2.resize(image[y : y + ch, x : x + cw], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    return out[:, ::-1] if rng.random() < 0.5 else out


def centre_crop(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    short = round(SIZE * 256 / 224)
    scale = short / min(h, w)
    image = cv2.resize(image, (round(w * scale), round(h * scale)), interpolation=cv2.INTER_LINEAR)
    h, w = image.shape[:2]
    y, x = (h - SIZE) // 2, (w - SIZE) // 2
    return image[y : y + SIZE, x : x + SIZE]


class Photos(Dataset[tuple[torch.Tensor, int]]):
    """What a DataLoader user writes for the built-in transforms: decode, crop, RGB CHW uint8."""

    def __init__(self, data: Path, augment: str) -> None:
        self.files = files_of(data)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        image = read_rgb(path)
        out = random_resized_crop(image, random.Random(i)) if self.augment == "train" else centre_crop(image)
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))), label


class Pipeline(Dataset[dict[str, Any]]):
    """The user's ``--pipeline`` function run by a DataLoader on the same samples."""

    def __init__(self, data: Path, spec: str) -> None:
        self.files = files_of(data)
        self.spec = spec

    def __len__(self) -> int:
        return len(self.files)

    def function(self) -> Callable[[Mapping[str, Any], np.random.Generator], Any]:
        import importlib.util

        path, name = self.spec.rsplit(":", 1)
        spec = importlib.util.spec_from_file_location("probe_pipeline", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)  # type: ignore[no-any-return]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not hasattr(self, "_function"):
            self._function = self.function()
        path, label = self.files[i]
        image = read_rgb(path)
        return self._function({"image": image, "label": label}, np.random.default_rng(i))  # type: ignore[no-any-return]


def one_thread(_: int) -> None:
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def dataloader_rate(dataset: Dataset[Any], workers: int, epochs: int) -> float:
    dl = DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=True,
        worker_init_fn=one_thread, prefetch_factor=2,
    )  # fmt: skip
    rates = [epoch_rate(iter(dl)) for _ in range(epochs)]
    return max(rates[1:] or rates)  # the first epoch starts the workers


def service_rate(work: Path, data: Path, flags: list[str], epochs: int) -> float:
    with service(work, data, flags) as (endpoint, _), loader(endpoint) as trainer:
        rates = [epoch_rate(iter(trainer)) for _ in range(epochs)]
    return max(rates[1:] or rates)


# --- the scenarios -------------------------------------------------------------------------------


def against_dataloader(args: argparse.Namespace, augment: str) -> dict[str, Any]:
    flags = ["--batch-size", str(BATCH), "--image-size", str(SIZE), "--augment", augment]
    flags += ["--workers", str(args.workers)]
    ours = service_rate(args.work, args.data, flags, args.epochs)
    theirs = dataloader_rate(Photos(args.data, augment), args.workers, args.epochs)
    return figure(ours / theirs, "x DataLoader", True, service=ours, dataloader=theirs)


def scenario_train(args: argparse.Namespace) -> dict[str, Any]:
    return against_dataloader(args, "train")


def scenario_eval(args: argparse.Namespace) -> dict[str, Any]:
    return against_dataloader(args, "eval")


def scenario_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """A user's albumentations pipeline (``--pipeline``) against a DataLoader running the same function."""
    flags = ["--batch-size", str(BATCH), "--pipeline", args.pipeline, "--workers", str(args.workers)]
    ours = service_rate(args.work, args.data, flags, args.epochs)
    theirs = dataloader_rate(Pipeline(args.data, args.pipeline), args.workers, args.epochs)
    return figure(ours / theirs, "x DataLoader", True, service=ours, dataloader=theirs)


def scenario_cold(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds to the first batch of 64 at 224 (train) of an epoch nothing decoded ahead, from an idle
    service with 2 workers: the median of several attaches, each to another epoch."""
    flags = ["--batch-size", "64", "--image-size", str(SIZE), "--augment", "train", "--workers", "2"]
    times = []
    with service(args.work, args.data, flags) as (endpoint, _):
        for epoch in range(3, 3 + (3 if args.quick else 7)):
            time.sleep(1.0)  # idle: whatever the last attach started has finished
            with loader(endpoint) as trainer:
                trainer.set_epoch(epoch)
                start = time.perf_counter()
                next(iter(trainer))
                times.append(time.perf_counter() - start)
    return figure(float(np.median(times)), "s", False, each=times)


def scenario_split(args: argparse.Namespace) -> dict[str, Any]:
    """A service held to one decode worker (the host's CPUs are the ceiling), train at 224: a loop
    that only pulls, its images/s when the trainer decodes a share found while it runs beside the
    service (``decode="auto"``, one thread; a revision without it gets the service alone), against
    the service alone in the same run. The better of the last epochs, the split settled by then."""
    flags = ["--batch-size", str(BATCH), "--image-size", str(SIZE), "--augment", "train", "--workers", "1"]
    epochs = args.epochs + 2
    with service(args.work, args.data, flags) as (endpoint, _):
        with loader(endpoint) as alone_loader:
            alone = max(epoch_rate(iter(alone_loader)) for _ in range(args.epochs))
        try:
            helped_loader = loader(endpoint, decode="auto", decode_threads=1)
        except TypeError:  # a revision before encoded rows: the service decodes every row
            helped_loader = loader(endpoint)
        with helped_loader as trainer:
            rates = [epoch_rate(iter(trainer)) for _ in range(epochs)]
            decode = trainer.stats().get("decode", {})
    helped = max(rates[-2:])
    return figure(
        helped, "images/s", True, service_alone=alone, ratio=helped / alone, each=rates, decode=decode
    )


def scenario_ramp(args: argparse.Namespace) -> dict[str, Any]:
    """A trainer attaches to an idle service started without ``--workers`` whose pipeline waits 10 ms
    a sample (batches of 16): its first epoch's images/s, from attach to the last batch."""
    pipeline = write_sleepy(args.work)
    samples = len(files_of(args.data))
    flags = ["--batch-size", "16", "--pipeline", pipeline]
    with service(args.work, args.data, flags, env={"PROBE_SAMPLE_SECONDS": "0.01"}) as (endpoint, _):
        time.sleep(2.0)  # the service idles a while before the trainer comes, as on a real host
        start = time.perf_counter()
        with loader(endpoint) as trainer:
            images = sum(len(b.indices) for b in trainer)
        seconds = time.perf_counter() - start
    return figure(images / seconds, "images/s", True, samples=samples, seconds=seconds)


def scenario_remote(args: argparse.Namespace) -> dict[str, Any]:
    """A trainer over TCP with CURVE (bytes over the socket): images/s of its second epoch."""
    import zmq.auth

    keys = Path(tempfile.mkdtemp(prefix="keys-", dir=args.work))
    (keys / "authorized").mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(keys / "authorized", "client")
    flags = ["--batch-size", str(BATCH), "--image-size", str(SIZE), "--augment", "train"]
    flags += ["--workers", str(args.workers), "--curve-secret-key", server_secret]
    flags += ["--curve-authorized", str(keys / "authorized")]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with (
        service(args.work, args.data, flags, endpoint=endpoint),
        loader(endpoint, transport="tcp", server_key=server_public, client_key=client_secret) as trainer,
    ):
        rates = [epoch_rate(iter(trainer)) for _ in range(args.epochs)]
    return figure(max(rates[1:] or rates), "images/s", True, client=client_public)


def scenario_straggler(args: argparse.Namespace) -> dict[str, Any]:
    """Three services of one worker each, one 5x slower (a sleep per sample): the fleet's images/s.
    The same three at one speed are measured beside it; the share of their rate is a detail (the
    capacity bound is 0.73), not the figure, since a revision whose even fleet is faster would read
    worse by it while its straggling fleet is faster too (measured: 1579eba's even fleet made 180
    images/s here, a later one's 277)."""
    fast = 0.01
    with_straggler = fleet_rate(args, [fast, fast, 5 * fast])
    even = fleet_rate(args, [fast] * 3)
    return figure(with_straggler, "images/s", True, even=even, share_of_even=with_straggler / even)


def fleet_rate(args: argparse.Namespace, seconds: list[float]) -> float:
    pipeline = write_sleepy(args.work)
    flags = ["--batch-size", "8", "--pipeline", pipeline, "--workers", "1"]
    with contextlib.ExitStack() as stack:
        endpoints = [
            stack.enter_context(service(args.work, args.data, flags, env={"PROBE_SAMPLE_SECONDS": str(s)}))[0]
            for s in seconds
        ]
        trainer = stack.enter_context(loader(endpoints))
        rates = [epoch_rate(iter(trainer)) for _ in range(args.epochs)]
    return max(rates[1:] or rates)


def scenario_idle_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes an idle service holds with no ``--workers`` (sized to this host): USS of every process of
    its tree plus its shared-memory segments."""
    flags = ["--batch-size", "64", "--image-size", str(SIZE), "--augment", "train"]
    with service(args.work, args.data, flags) as (_, proc):
        time.sleep(3.0 if args.quick else 8.0)  # whatever it decodes ahead at start is done
        uss = sum(uss_of(pid) for pid in tree_of(proc.pid))
        shm = sum(
            os.stat(f"/dev/shm/{name}").st_blocks * 512
            for name in os.listdir("/dev/shm")
            if name.startswith(f"dataferry-{proc.pid}-")
        )
    return figure(float(uss + shm), "bytes", False, uss=uss, shm=shm)


def tree_of(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        found.append(parent)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
                todo += [int(c) for c in children]
    return found


def uss_of(pid: int) -> int:
    """Unique set size: private pages (``smaps_rollup``), what the process alone costs."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)
    return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def write_sleepy(work: Path) -> str:
    path = work / "sleepy_pipeline.py"
    path.write_text(SLEEPY)
    return f"{path}:sleepy"


def figure(value: float, unit: str, higher_is_better: bool, **detail: Any) -> dict[str, Any]:
    return {"value": value, "unit": unit, "higher_is_better": higher_is_better, "detail": detail}


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "train": scenario_train,
    "eval": scenario_eval,
    "pipeline": scenario_pipeline,
    "cold": scenario_cold,
    "ramp": scenario_ramp,
    "split": scenario_split,
    "remote": scenario_remote,
    "straggler": scenario_straggler,
    "idle_memory": scenario_idle_memory,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--pipeline", default="")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        result = {"scenario": args.scenario, **SCENARIOS[args.scenario](args)}
    except Exception as exc:  # a revision that cannot run this scenario: said, not fatal to the run
        result = {"scenario": args.scenario, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
