"""Helpers shared by the test tiers: real service processes, status queries, trainer threads.

Fixtures live in ``tests/conftest.py``; what a test imports lives here, so no test module imports
another.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import zmq

from gpu_worker import ServiceLoader
from loader_service.config.feed import AUTO_ENCODED_ROW_BYTES
from protocol.codec import decode, encode
from protocol.curve import ClientKeys
from protocol.layout import PAGE, SlotLayout, image_fields
from protocol.messages import StatusReply, StatusRequest
from protocol.status import (
    SLOT_STATES,
    CacheStatus,
    FeedSource,
    FeedStatus,
    LoadStatus,
    ServiceStatus,
    SessionSource,
    SessionStatus,
    ShmStatus,
    SizingDecision,
    SizingStatus,
    SizingWindow,
    WorkerStatus,
)

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[1]


def our_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("dataferry-")}


def left_behind(before: set[str]) -> set[str]:
    """Segments that appeared since ``before`` and whose service is gone: a leak. (Other processes'
    segments, a benchmark's or another test run's, may appear and vanish meanwhile.)"""
    return {name for name in our_segments() - before if not owner_running(name)}


def pool_bytes(service_pid: int, shm: Path = SHM, feed: str = "train") -> int:
    """Memory backing a service's slot pool now: blocks of its segment in ``shm``, not its size."""
    (name,) = [n for n in os.listdir(shm) if n.startswith(f"dataferry-{service_pid}-{feed}-")]
    return os.stat(shm / name).st_blocks * 512


def slot_reserve(batch_size: int, image_size: int) -> int:
    """Bytes a slot of the built-in transforms' feed reserves when added (``SlotPool``'s ``ahead``,
    whole pages): everything but its room for encoded rows, which the default offers and reserves
    only once a batch there leaves a row encoded (NOTE [ Encoded rows ])."""
    room = max(3 * image_size**2, AUTO_ENCODED_ROW_BYTES)
    layout = SlotLayout(batch_size, image_fields(image_size), room)
    return -(-layout.bytes_offset // PAGE) * PAGE


def owner_running(segment: str) -> bool:
    """Is the service whose pid is in ``segment``'s name still running (another run's, say), or does
    a live process hold its flock (a service in another pid namespace, as a test plants one)?"""
    head = segment[len("dataferry-") :].split("-", 1)[0]
    if head.isdigit() and Path(f"/proc/{head}").exists():
        return True
    try:
        fd = os.open(f"/dev/shm/{segment}", os.O_RDONLY)
    except OSError:
        return False  # gone meanwhile: nobody leaked it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class ServiceProcess:
    """``loader-service serve`` as a child process, with its stderr collected line by line."""

    def __init__(
        self,
        args: list[str],
        endpoint: str,
        env: dict[str, str] | None = None,
        private_shm: bool = False,
        python: str = sys.executable,
        cwd: Path = REPO,
        program: list[str] | None = None,
    ) -> None:
        """``private_shm``: the service gets its own empty /dev/shm, as on another host (the same
        process: ``unshare`` and ``sh`` exec it, so signals reach it; its segments go with it).
        ``python`` and ``cwd``: another install's interpreter, run where the checkout is not on its
        path. ``program``: what runs ``args`` (default ``python -m loader_service``; the console
        script, ``console_script("loader-service")``, as a user runs it)."""
        self.args = args
        self.endpoint = endpoint
        isolate = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM]
        program = program or [python, "-m", "loader_service"]
        self.proc = subprocess.Popen(
            [*(isolate if private_shm else []), *program, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=cwd,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0, count: int = 1) -> re.Match[str]:
        """Wait for ``count`` stderr lines matching ``pattern``; fail with the log if the process exits."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        found = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        found += 1
                        if found >= count:
                            return m
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"service exited ({self.proc.returncode}) before {pattern!r}:\n{self.log}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.log}")
                self._changed.wait(remaining)

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"service did not stop within {timeout} s:\n{self.log}") from None
        self._close_pipe()
        return code

    def _close_pipe(self) -> None:
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._close_pipe()


def console_script(name: str) -> list[str]:
    """The installed console script next to this interpreter, else ``python -m``."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", name.replace("-", "_")]


PLANT = """
import os, sys
with open({marker!r}, "a") as note:
    note.write(f"{{__name__}} ran in pid {{os.getpid()}} (uid {{os.getuid()}}): {{sys.argv}}\\n")
os._exit(3)
"""
PLANTED = ("loader_service/__init__.py", "multiprocessing/__init__.py", "runpy.py")
"""The service's own package, what every multiprocessing child (its workers' template, the resource
tracker, a spawned process) imports first, and what ``python -m`` imports."""


def plant_packages(folder: Path, marker: Path) -> None:
    """Leave in ``folder`` what another user could (a review's re-ran the real service on other data:
    the trainer trained on all-white images, no error): each of ``PLANTED`` notes in ``marker`` that
    it ran, in which process, as whom, and ends that process
    (NOTE [ Nothing from the working folder ] in loader_service/working_folder.py)."""
    for planted in PLANTED:
        (folder / planted).parent.mkdir(parents=True, exist_ok=True)
        (folder / planted).write_text(PLANT.format(marker=str(marker)))


ServiceFactory = Callable[..., ServiceProcess]
SourceData = Callable[[str], tuple[str, "dict[str, str] | None"]]
"""The ``data_of`` fixture: a data format to (``--data``, the service's extra environment)."""


T = TypeVar("T")


@contextlib.contextmanager
def in_background(job: Callable[[], T], what: str, timeout: float = 90) -> Iterator[Future[T]]:
    """``job`` on a thread while the test breaks something: ``.result()`` gives what it returned or
    raises its failure; a failure of the test itself is noted with the job's (waited for up to
    ``timeout``). The thread is joined on the way out."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(job)
        try:
            yield future
        except BaseException as exc:
            error = future.exception(timeout)
            if error is not None:
                exc.add_note(f"{what} failed too: {error!r}")
            raise


def in_threads(jobs: list[Callable[[], Any]], timeout: float = 120) -> list[Any]:
    """Run ``jobs`` concurrently; return their results, re-raising the first failure."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a trainer thread hung"
    if errors:
        raise errors[0]
    return results


def epoch_indices(loader: ServiceLoader) -> tuple[list[int], int]:
    seen: list[int] = []
    batches = 0
    for batch in loader:
        seen += batch.indices.tolist()
        batches += 1
    return seen, batches


def status(endpoint: str, server_key: str = "", client_key: str = "") -> dict[str, Any]:
    """The service's status body, asked on a fresh connection (with CURVE keys where given)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = ClientKeys.load(server_key, client_key, environ={})
    if keys is not None:
        keys.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(encode(StatusRequest()))
        deadline = time.monotonic() + 10
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frame = sock.recv()
            try:
                return dict(decode(frame, (StatusReply,)).body)
            except ValueError:
                continue  # a heartbeat or other message
        raise AssertionError("no status reply")
    finally:
        sock.close(linger=0)
        ctx.term()


def trainer_process(endpoint: str, script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, endpoint, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


DIE_AFTER = """
import os, signal, sys
from gpu_worker import ServiceLoader
endpoint, batches, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kwargs = dict(mode="broadcast", group="g", group_size=3) if mode == "broadcast" else {}
loader = ServiceLoader(endpoint, timeout=30, **kwargs)
for i, batch in enumerate(loader):
    if i + 1 == batches:
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@contextlib.contextmanager
def shm_segment(tag: str, size: int, fill: Callable[[mmap.mmap], None]) -> Iterator[str]:
    """A real segment of ours of ``size`` bytes, named as the service names them, written by
    ``fill``; removed afterwards, pass or fail. Its flock is held while it is in use, as a service
    holds its own (NOTE [ Shared-memory cleanup ]): a test process is no service by its command line,
    so without it a service another test worker starts meanwhile removes the segment as stale."""
    name = f"dataferry-{os.getpid()}-{tag}-{os.urandom(3).hex()}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            fill(m)
        yield name
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


@contextlib.contextmanager
def fake_segment(fill: int = 0) -> Iterator[str]:
    """One slot of 4 images of 8 px, every byte ``fill`` (``shm_segment``). For fake services that
    announce a pool."""
    size = SlotLayout.images(4, 8).segment_bytes(1)

    def write(m: mmap.mmap) -> None:
        m[:] = bytes([fill]) * size

    with shm_segment("fake", size, write) as name:
        yield name


def consume_with_pause(
    loader: ServiceLoader, pause_after: int, paused: threading.Event, go: threading.Event
) -> list[int]:
    """One epoch; after ``pause_after`` batches, wait (holding nothing) until ``go`` is set."""
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen += batch.indices.tolist()
        del batch
        if i + 1 == pause_after:
            paused.set()
            assert go.wait(60)
    return seen


# --- the same photos as other sources ------------------------------------------------------------
# Rows and shard members follow the ImageFolder index's order, so sample i is the same file in every
# source: a feed over any of them must deliver the ImageFolder feed's indices, labels and pixels.


def folder_samples(root: Path) -> list[tuple[str, int]]:
    """(path relative to ``root``, label) of every sample, in ImageFolder index order."""
    from loader_service.dataset.index import build_index

    index = build_index(root, "imagefolder")
    return [(index.relpath(i), int(index.labels[i])) for i in range(len(index))]


def write_csv_list(root: Path, out: Path) -> Path:
    """A .csv list of ``root``'s photos (absolute paths), with a metadata column."""
    import csv

    with open(out, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "caption"])
        for i, (rel, label) in enumerate(folder_samples(root)):
            writer.writerow([str(root / rel), label, f"photo {i}"])
    return out


def write_jsonl_list(root: Path, folder: Path) -> Path:
    """A .jsonl list in ``folder`` naming ``root``'s photos by paths relative to ``folder``."""
    out = folder / "train.jsonl"
    with open(out, "w", encoding="utf-8") as fh:
        for i, (rel, label) in enumerate(folder_samples(root)):
            path = os.path.relpath(root / rel, folder)
            fh.write(json.dumps({"path": path, "label": label, "box": [i, i + 1]}) + "\n")
    return out


def write_tar(path: Path, members: Iterable[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> Path:
    """A tar file holding ``members`` (name, bytes) in order, as Python's tarfile writes it."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_shards(root: Path, out: Path, per_shard: int = 16) -> list[Path]:
    """WebDataset-style shards of ``root``'s photos: KEY.jpg, KEY.cls and KEY.json per sample."""
    from testkit.fixtures import write_shards as write

    return write(root, out, per_shard)


class CountingDecoder:
    """The real region decoder, counting its decodes: equal pixels alone cannot show it ran."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.header = module.header
        self.LIBJPEG_TURBO_VERSION_NUMBER = module.LIBJPEG_TURBO_VERSION_NUMBER
        self.calls = 0

    def decode(self, *args: Any) -> Any:
        self.calls += 1
        return self.module.decode(*args)


PRIVATE_SHM = 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$0" "$@"'
"""``sh -c`` prefix that gives the command its own empty /dev/shm: "another host" for shared memory."""


def private_shm_available() -> bool:
    """Can a process get its own /dev/shm here (``unshare --mount``: root or user namespaces)?"""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "true"],
        check=False,
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll the service's own account (status) until ``condition``: there is no event to wait on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


Received = dict[int, tuple[int, str]]
"""Sample index -> (label, sha1 of its pixels) over one epoch."""


def receive_epoch(loader: ServiceLoader) -> Received:
    got: Received = {}
    for batch in loader:
        for row, idx in enumerate(batch.indices.tolist()):
            assert idx not in got, f"sample {idx} delivered twice in one epoch"
            pixels = hashlib.sha1(batch.images[row].numpy().tobytes()).hexdigest()
            got[idx] = (int(batch.labels[row]), pixels)
    return got


def write_config(path: Path, top: dict[str, Any], feeds: dict[str, dict[str, Any]]) -> Path:
    """A TOML config file; values are str, int or a nested table of fields."""

    def value(v: Any) -> str:
        return json.dumps(str(v)) if isinstance(v, (str, Path)) else json.dumps(v)

    lines = [f"{k} = {value(v)}" for k, v in top.items()]
    for name, table in feeds.items():
        lines.append(f"[feeds.{name}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit waits for whatever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def template_of(service: ServiceProcess) -> int:
    """The pid of the process the service's workers are forked from (NOTE [ Workers from a template ])."""
    return child_of(service, b"forkserver", "template")


def child_of(service: ServiceProcess, command: bytes, what: str) -> int:
    """The pid of the service's running child whose command line holds ``command`` (the template's:
    ``forkserver``; multiprocessing's resource tracker: ``resource_tracker``), a child of whichever
    of the service's threads started it."""
    children: list[str] = []
    for task in Path(f"/proc/{service.proc.pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            children += (task / "children").read_text().split()
    for child in map(int, children):
        with contextlib.suppress(OSError):  # gone meanwhile
            if command in Path(f"/proc/{child}/cmdline").read_bytes() and running(child):
                return child
    raise AssertionError(f"no {what} among the service's children {children}")


def busy_worker(endpoint: str) -> int | None:
    for worker in status(endpoint)["worker_list"]:
        if worker["task"] is not None:
            return int(worker["pid"])
    return None


def assert_feeds_match(endpoint: str, names: Iterable[str], n: int, batch_size: int) -> list[Received]:
    """Two epochs of the service's first feed, each giving every one of the ``n`` samples once, and
    every feed of ``names`` giving exactly those epochs (labels and pixels); the first feed's epochs."""
    with ServiceLoader(endpoint, timeout=30) as loader:
        reference = [receive_epoch(loader) for _ in range(2)]
    assert all(sorted(epoch) == list(range(n)) for epoch in reference)
    for name in names:
        with ServiceLoader(endpoint, feed=name, timeout=30) as loader:
            assert len(loader) == -(-n // batch_size)
            for epoch in range(2):
                assert receive_epoch(loader) == reference[epoch], f"{name}: epoch {epoch} differs"
    return reference


def feed_formats_without_bad_files(endpoint: str) -> dict[str, str]:
    """Each feed's format, by name, once checked that no feed has met a bad file."""
    feeds = status(endpoint)["feeds"]
    assert all(f["bad_files"] == 0 for f in feeds), feeds
    return {f["name"]: f["format"] for f in feeds}


def write_parquet(root: Path, folder: Path, files: int = 1) -> Path:
    """``root``'s photos as the Parquet files Hugging Face ``datasets`` writes (``sample_data``)."""
    from testkit.fixtures import write_parquet as write

    return write(root, folder, files)


def job_steps(
    endpoint: str,
    world: int,
    steps: int,
    state: dict[str, Any] | None = None,
    rows: Callable[[Any], list[Any]] = lambda batch: batch.indices.tolist(),
    change: tuple[dict[str, float], int] | None = None,
    **loader: Any,
) -> tuple[list[Any], Any]:
    """A job of ``world`` ranks (one loader each, on one service, ``remainder="drop"``, ``loader``'s
    other arguments) taking ``steps`` batches each, in step (-1: to the epoch's end), from ``state``
    if given, every rank calling ``set_weights(*change)`` first if given: ``rows`` of every batch it
    took, and rank ``world - 1``'s state after its last step (any rank's would do: NOTE [ Elastic
    epochs ])."""
    loaders = [
        ServiceLoader(endpoint, rank=r, world_size=world, remainder="drop", timeout=60, **loader)
        for r in range(world)
    ]
    try:
        for each in loaders:
            if state is not None:
                each.load_state_dict(json.loads(json.dumps(state)))
            if change is not None:
                each.set_weights(*change)
        passes = [iter(each) for each in loaders]
        taken: list[Any] = []
        step = 0
        while steps < 0 or step < steps:
            batches = [next(p, None) for p in passes]
            if any(b is None for b in batches):
                assert all(b is None for b in batches), "every rank ends its share together"
                break
            taken += [row for b in batches if b is not None for row in rows(b)]
            del batches
            step += 1
        return taken, loaders[-1].state_dict()
    finally:
        for each in loaders:
            each.close()


def fake_root(root: Path, files: dict[str, str]) -> Path:
    """A file tree under ``root`` standing for a host's ``/`` (``proc/...``, ``sys/fs/cgroup/...``):
    each of ``files``, a path relative to it, holding its text."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def whole_status() -> ServiceStatus:
    """A status with every record of the body in it once, and two sessions of one trainer
    (NOTE [ Status contract ]): a field added to the contract must be given here too."""
    ledger = (SessionSource(source="a", served=4, share=1.0, asked=0.25, passes=1, position=3),)
    session = SessionStatus(
        session="t1", client="host:1", feed="train", mode="shard", rank=0, world_size=1, group="",
        epoch=2, delivered=9, leased=1, resent=0, recovered_releases=0, credits=2, credits_asked=4,
        lag=1, idle_seconds=0.1, demand=1.5, encode_share=0.25, spoiled=0, sources=ledger,
    )  # fmt: skip
    feed = FeedStatus(
        name="train", samples=90, slots=dict.fromkeys(SLOT_STATES, 1), slots_most=8,
        credits_most=8, pool_refused=0, pool_given_back=0, encoded_room_refused=0, decoded=10,
        images_per_second=2.5, warm_decoded=0, split_batches=0, encoded_rows=4, encoded_row_bytes=0,
        batches=2, bad_files=1, store_waits=0, recent_bad_files=("x.jpg",), format="folder",
        augment="train", interpolation="bilinear", fields=("image uint8[3, 8, 8]",),
        cache=CacheStatus(kind="decoded", bytes=9, bytes_used=1, entries=1, hits=1, misses=1, full=False,
                          lock_timeouts=0),
        sources=(FeedSource(source="a", samples=40, served=4), FeedSource(source="b", samples=50, served=6)),
    )  # fmt: skip
    sizing = SizingStatus(
        mode="auto", active=2, started=3, most=4, budget=2.0,
        window=SizingWindow(busy=0.5, cost=1.0, rate=9.0, demand=1.2, step_ms=None),
        decisions=(SizingDecision(seconds_ago=1.0, before=1, after=2, reason="trainers waited"),),
    )  # fmt: skip
    return ServiceStatus(
        uptime=5.0, attached=2, workers=1, worker_restarts=0, template_restarts=0, rejected_messages=0,
        remote_send_bytes=0, load=LoadStatus(load=1.0, busy=0.5, demand=2.0),
        shm=ShmStatus(free_bytes=3, size_bytes=10, floor_bytes=1), sizing=sizing,
        worker_list=(WorkerStatus(worker=0, pid=7, task=None, ready=True, decoded=10,
                                  images_per_second=2.5),),
        feeds=(feed,), feeds_left_out=0, sessions=(session, session), sessions_left_out=0,
    )  # fmt: skip
