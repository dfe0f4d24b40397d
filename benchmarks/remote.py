"""(j): a trainer on another host (TCP with CURVE) against a local one, and the transport alone.

Everything runs on this machine, over loopback. The "remote" trainer is a ServiceLoader forced to
``transport="tcp"``: it gets each batch's bytes over the socket instead of mapping the pool, as a
trainer on another host does; only a real network is missing.

NOTE [ Timing the transport alone ]
    A batch decoded while it is sent measures the decoder, not the wire. So a transfer is timed only
    when every batch it receives was decoded before it began, and no decoding runs during it:
    * The trainer's credits are ``K`` (``transport_batches``, at most one epoch) and the pool has room
      for them; once the trainer has released an epoch, the service decodes the first ``K`` batches
      of the next one ahead (NOTE [ Warm start ], lane ``ahead``) and then idles.
    * Before a transfer the service's status must show no slot filling, at least ``K`` ready and
      every decode worker without a task; then this benchmark's whole process tree must be idle.
    * The decode workers are stopped (SIGSTOP) for the timed window and continued (SIGCONT) after
      it, on every path. The loop lets each batch go as a training loop does, so its release goes
      back at once; without the pause that credit would start decoding the following epoch on the
      same two cores. The service's main process, which does all the sending, runs normally; a
      worker paused for a second is far inside ``--task-timeout``, and an idle one has no task anyway.
    * Timed: from the ``iter()`` that sends the start to the K-th batch handed to the loop.
    Holding all K batches instead (no release, so no pause needed) was tried first: it receives every
    transfer into fresh memory, and on this virtual machine faulting those pages in cost the trainer
    more than the receiving did. A loop that releases as it goes reuses its buffers.
    Bytes are those of the K batches' tensors (every field, and the indices) as the loop receives them.
    Over shared memory nothing moves: the same count per second is the cost of announcing and
    wrapping ready slots, the local path the TCP figures are compared with. A raw pyzmq pair
    (``wire``) moves as many frames of the same size in the same rounds: ZeroMQ's own ceiling here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.contenders import Contender
from benchmarks.proctree import cpu_seconds, tree
from benchmarks.progress import progress
from benchmarks.results import (
    SERVICE_TREE,
    TCP_CURVE,
    TCP_PLAIN,
    TF_DATA_SERVICE_GB_S,
    TRAINER,
    ZMQ_CURVE,
    ZMQ_PLAIN,
    ZMQ_RECEIVER,
    ZMQ_SENDER,
    Measurement,
    Timeline,
)
from benchmarks.scenarios import interleaved_rounds, rotated, wait_idle
from benchmarks.service_process import BenchError, ServiceProcess
from benchmarks.wire import GB, Transfer
from gpu_worker import ServiceLoader
from gpu_worker.batch import Batch
from loader_service.tools.keys import make_keys
from loader_service.tools.status_view import query_status

READY_POLL = 0.05
"""Seconds between status queries while the service decodes a transfer's batches ahead."""
CPU_ROWS = {TCP_CURVE: ZMQ_CURVE, TCP_PLAIN: ZMQ_PLAIN}
"""CPU per GB is reported for these dataferry transports, each beside its raw ZeroMQ pair. Over shm
a transfer takes milliseconds: too few CPU clock ticks to divide."""


@dataclass(frozen=True)
class CurveFiles:
    """The service's key pair, one trainer's key pair, and the folder of trainers the service admits."""

    service_public: Path
    service_secret: Path
    trainer_secret: Path
    authorized: Path

    def service_args(self) -> tuple[str, ...]:
        return ("--curve-secret-key", str(self.service_secret), "--curve-authorized", str(self.authorized))

    def client(self) -> tuple[str, str]:
        """``server_key`` and ``client_key`` as a ServiceLoader (or a status query) takes them."""
        return str(self.service_public), str(self.trainer_secret)


def make_curve_files(folder: Path) -> CurveFiles:
    """Real key pairs, made as an operator would (``loader-service keys``), in ``folder``."""
    service = make_keys(folder / "service", "service")
    trainer = make_keys(folder / "trainer", "trainer")
    authorized = folder / "authorized"
    authorized.mkdir()
    shutil.copy(trainer.public, authorized / trainer.public.name)
    return CurveFiles(service.public, service.secret, trainer.secret, authorized)


# --- a remote trainer against a local one, with decoding ----------------------------------------


def measure_remote_rate(
    contenders: Sequence[Contender], rounds: int, batches: int
) -> tuple[list[Measurement], dict[str, Timeline]]:
    """(j) images/s and CPU per 1000 images of the remote trainers and the local one, timed as (a)
    times its contenders: one at a time, in rounds whose order rotates, so each has the whole
    machine while timed."""
    got = interleaved_rounds(contenders, rounds, batches, "(j) remote and local trainer rounds")
    title = "remote trainers (TCP+CURVE, plain TCP) and a local shm trainer"
    cpu_title = "CPU-seconds per 1000 images, all processes"
    measurements = [
        Measurement("j", "j-rate", title, "images/s", got.rates, paired=True),
        Measurement("j", "j-cpu-images", cpu_title, "CPU-s", got.cpu_per_1000, paired=True),
    ]
    return measurements, got.timelines


# --- the transport alone (NOTE [ Timing the transport alone ]) ----------------------------------


class Timed(Protocol):
    """Something whose transfers of ``count`` ready batches (or frames) can be timed."""

    key: str

    def warm(self, count: int) -> None:
        """One untimed transfer, so first-use costs stay out of the rounds."""

    def prepare(self, count: int) -> None:
        """Block until the next transfer's batches are ready."""

    def transfer(self, count: int) -> Transfer: ...


def batch_bytes(batch: Batch) -> int:
    """Bytes of a batch as received: every field, then the indices."""
    return sum(t.nbytes for t in batch.values()) + batch.indices.nbytes


def drain(epoch: Iterable[Batch]) -> None:
    """Consume the rest of an epoch holding nothing (a batch left in a variable would keep a credit)."""
    deque(epoch, maxlen=0)


def _ready_workers(status: dict[str, Any], batches: int) -> list[int] | None:
    """The decode workers' pids if ``batches`` slots are ready and nothing is being decoded, else None."""
    feeds, workers = status.get("feeds") or [{}], status.get("worker_list") or []
    slots = feeds[0].get("slots", {})
    if any(w.get("task") is not None for w in workers) or slots.get("filling", 1) != 0:
        return None
    return [int(w["pid"]) for w in workers] if slots.get("ready", 0) >= batches else None


@contextlib.contextmanager
def decoding_paused(workers: Sequence[int]) -> Iterator[None]:
    """Decode workers stopped for the ``with`` body and continued after it, whatever happens."""
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class Transport:
    """A ServiceLoader with ``K`` credits, whose transfers are the next epoch's first ``K`` batches."""

    def __init__(
        self, key: str, loader: ServiceLoader, service: ServiceProcess, client: tuple[str | None, str | None]
    ) -> None:
        self.key = key
        self.loader = loader
        self.service = service
        self._client = client
        """The keys a status query presents (CURVE), or (None, None)."""
        self._workers: list[int] = []
        self._timeout = loader.config.timeout

    def warm(self, count: int) -> None:
        drain(iter(self.loader))  # epoch 0: decoded on demand; its end starts the decoding ahead

    def prepare(self, count: int) -> None:
        """Wait until ``count`` slots are ready and the service decodes nothing more."""
        endpoint = self.service.spec.endpoint
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            status = query_status(endpoint, self._timeout, *self._client)
            workers = _ready_workers(status, count)
            if workers is not None:
                self._workers = workers
                return
            time.sleep(READY_POLL)  # the service's state, polled: there is no event to wait on
        raise BenchError(f"{self.key}: the service did not decode {count} batches ahead in time")

    def transfer(self, count: int) -> Transfer:
        """The next epoch's first ``count`` batches, all ready before the start; the rest untimed."""
        service_pids, trainer = tree(self.service.pid), [os.getpid()]
        with decoding_paused(self._workers):
            service_before, trainer_before = cpu_seconds(service_pids), cpu_seconds(trainer)
            start = time.perf_counter()
            epoch = iter(self.loader)
            nbytes = 0
            for _ in range(count):
                batch = next(epoch)
                nbytes += batch_bytes(batch)
                del batch  # its release goes out with the next call, as in a training loop
            seconds = time.perf_counter() - start
            trainer_cpu = cpu_seconds(trainer) - trainer_before
            service_cpu = cpu_seconds(service_pids) - service_before
        drain(epoch)
        return Transfer(nbytes, seconds, service_cpu, trainer_cpu)


def _transfer_rounds(timed: Sequence[Timed], rounds: int, count: int) -> dict[str, list[Transfer]]:
    for t in timed:
        t.warm(count)
    got: dict[str, list[Transfer]] = {t.key: [] for t in timed}
    bar = progress("(j) ready batches per transport", rounds * len(timed))
    for r in range(rounds):
        for t in rotated(timed, r):
            t.prepare(count)
            wait_idle()
            got[t.key].append(t.transfer(count))
            bar.update()
    bar.close()
    return got


def _cpu_per_gb(transfers: Sequence[Transfer], sender: bool) -> list[float]:
    return [(x.sender_cpu if sender else x.receiver_cpu) / (x.nbytes / GB) for x in transfers]


def measure_transport(timed: Sequence[Timed], rounds: int, count: int) -> list[Measurement]:
    """(j): GB/s of ready batches per transport in rounds whose order rotates; CPU per GB over TCP."""
    got = _transfer_rounds(timed, rounds, count)
    rates = {key: [x.nbytes / x.seconds / GB for x in xs] for key, xs in got.items()}
    notes = {"batches": float(count), "tf_data_service_gb_s": TF_DATA_SERVICE_GB_S}
    title = "ready batches handed to the loop (raw ZeroMQ: frames received)"
    measurements = [Measurement("j", "j-transport", title, "GB/s", rates, paired=True, notes=notes)]
    for ours, raw in CPU_ROWS.items():
        if ours in got and raw in got:
            cpu = {
                SERVICE_TREE: _cpu_per_gb(got[ours], sender=True),
                TRAINER: _cpu_per_gb(got[ours], sender=False),
                ZMQ_SENDER: _cpu_per_gb(got[raw], sender=True),
                ZMQ_RECEIVER: _cpu_per_gb(got[raw], sender=False),
            }
            title = f"CPU-seconds per GB over {ours}, each side, and a raw ZeroMQ pair's"
            measurements.append(Measurement("j", f"j-cpu-{ours}", title, "CPU-s/GB", cpu, paired=True))
    return measurements
