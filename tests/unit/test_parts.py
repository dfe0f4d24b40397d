"""Split batches (NOTE [ Split batches ]) without processes: how a batch is cut into parts, how the
rows are closed up in a real shared-memory segment, and the scheduler's bookkeeping of parts through
reports, worker deaths, give-ups and abandoned plans, with stand-in workers writing the slot."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from loader_service.config import ServiceConfig
from loader_service.decode.contract import WorkerConfig, slot_views
from loader_service.decode.progress import PREFETCHING, ProgressBoard
from loader_service.shm import Segment
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.rates import FeedCounters
from loader_service.supervisor.slots import SlotPool, SlotState
from loader_service.supervisor.streams.stream import Stream
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.trainers.sessions import Session
from loader_service.supervisor.workers.parts import (
    MIN_PART_ROWS,
    SplitBatch,
    compact,
    parts_per_batch,
    plan_parts,
    share_out,
)
from loader_service.supervisor.workers.pool import WorkerHandle, WorkerSet
from loader_service.supervisor.workers.scheduler import MAX_TASK_ATTEMPTS, Scheduler
from protocol.codec import decode, encode
from protocol.layout import FieldSpec, SlotLayout
from protocol.messages import Hello, Message
from protocol.workers import Task, TaskDone
from tests.helpers import shm_segment

# --- planning parts -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 7, 8, 15, 16, 17, 31, 64, 65, 200])
@pytest.mark.parametrize("workers", [1, 2, 3, 8, 60])
def test_parts_cover_the_batch_in_order(rows: int, workers: int) -> None:
    parts = plan_parts(rows, workers)
    starts = [start for start, _ in parts]
    sizes = [size for _, size in parts]
    assert starts == [sum(sizes[:k]) for k in range(len(parts))], "consecutive, from row 0"
    assert sum(sizes) == rows
    assert 1 <= len(parts) <= workers
    assert max(sizes) - min(sizes) <= 1, "as even as rows allow"
    if len(parts) > 1:
        assert min(sizes) >= MIN_PART_ROWS
    assert len(parts) == max(1, min(workers, rows // MIN_PART_ROWS)), "as many parts as allowed"


def test_a_small_batch_or_one_worker_stays_whole() -> None:
    assert plan_parts(15, 8) == [(0, 15)]
    assert plan_parts(64, 1) == [(0, 64)]
    assert plan_parts(64, 2) == [(0, 32), (32, 32)]
    assert plan_parts(10, 4, min_rows=3) == [(0, 4), (4, 3), (7, 3)]


@pytest.mark.parametrize(
    ("workers", "window", "parts"),
    [(2, 0, 1), (2, 6, 1), (2, 4, 1), (2, 2, 2), (16, 6, 6), (16, 48, 1), (16, 31, 2)],
)
def test_batches_are_cut_so_that_half_the_window_keeps_every_worker_busy(
    workers: int, window: int, parts: int
) -> None:
    assert parts_per_batch(workers, window) == parts


@pytest.mark.parametrize(("batches", "spare"), [(1, 0), (1, 5), (3, 2), (3, 7), (4, 4), (2, 15)])
def test_spare_workers_are_shared_evenly_earlier_batches_first(batches: int, spare: int) -> None:
    extra = share_out(batches, spare)
    assert len(extra) == batches and sum(extra) == spare
    assert max(extra) - min(extra) <= 1 and extra == sorted(extra, reverse=True)


def test_a_split_batch_is_complete_only_when_every_part_reported() -> None:
    batch = SplitBatch((0, 11, 22))
    assert not batch.report(22, 10)
    assert not batch.report(0, 11)
    with pytest.raises(ValueError):
        batch.report(0, 11)
    assert batch.report(11, 0)
    assert batch.runs() == [(0, 11), (11, 0), (22, 10)]


# --- compaction in shared memory ------------------------------------------------------------------

LAYOUT = SlotLayout(
    24,
    (
        FieldSpec("image", "uint8", (3, 2, 2)),
        FieldSpec("label", "int64", ()),
        FieldSpec("box", "float32", (2,)),
    ),
)
SLOTS = 2


@pytest.fixture
def segment() -> Iterator[Segment]:
    """A real segment of ours holding ``SLOTS`` slots of ``LAYOUT``, every byte 0xEE."""
    size = LAYOUT.segment_bytes(SLOTS)

    def fill(m: mmap.mmap) -> None:
        m[:] = b"\xee" * size

    with shm_segment("parts", size, fill) as name:
        seg = Segment.attach(name, size)
        yield seg
        seg.close()


def write_row(segment: Segment, slot: int, row: int, idx: int) -> None:
    """What a worker writes for sample ``idx``: values derived from ``idx`` in every field."""
    views = slot_views(segment, LAYOUT, slot, SLOTS)
    views.fields["image"][row] = idx % 251
    views.fields["label"][row] = idx * 10
    views.fields["box"][row] = (idx, -idx)
    views.indices[row] = idx


def assert_rows(segment: Segment, slot: int, expected: list[int]) -> None:
    views = slot_views(segment, LAYOUT, slot, SLOTS)
    n = len(expected)
    assert views.indices[:n].tolist() == expected
    assert views.fields["label"][:n].tolist() == [i * 10 for i in expected]
    assert views.fields["box"][:n].tolist() == [[float(i), float(-i)] for i in expected]
    assert [int(views.fields["image"][r].min()) for r in range(n)] == [i % 251 for i in expected]
    assert [int(views.fields["image"][r].max()) for r in range(n)] == [i % 251 for i in expected]


def test_compaction_closes_the_gaps_bad_samples_left_in_every_field(segment: Segment) -> None:
    # Three parts of 8 rows from rows 0, 8, 16; part 0 lost 2 samples, part 1 all 8, part 2 one.
    runs = [(0, 6), (8, 0), (16, 7)]
    good = {0: [100, 101, 102, 103, 104, 105], 16: [300, 301, 302, 303, 304, 305, 306]}
    for start, samples in good.items():
        for k, idx in enumerate(samples):
            write_row(segment, 1, start + k, idx)
    write_row(segment, 0, 0, 999)  # the other slot must not move
    views = slot_views(segment, LAYOUT, 1, SLOTS)
    assert compact(views, runs) == 13
    assert_rows(segment, 1, good[0] + good[16])
    assert_rows(segment, 0, [999])


def test_compaction_moves_overlapping_rows_correctly(segment: Segment) -> None:
    # Part 1's 10 rows move down by 2 onto rows they overlap.
    expected = list(range(50, 52)) + list(range(60, 70))
    for k, idx in enumerate(expected[:2]):
        write_row(segment, 0, k, idx)
    for k, idx in enumerate(expected[2:]):
        write_row(segment, 0, 4 + k, idx)
    assert compact(slot_views(segment, LAYOUT, 0, SLOTS), [(0, 2), (4, 10)]) == 12
    assert_rows(segment, 0, expected)


def test_compaction_of_gapless_parts_leaves_the_rows_as_written(segment: Segment) -> None:
    for row in range(20):
        write_row(segment, 0, row, 7 + row)
    assert compact(slot_views(segment, LAYOUT, 0, SLOTS), [(0, 10), (10, 10)]) == 20
    assert_rows(segment, 0, list(range(7, 27)))


# --- the scheduler's bookkeeping of parts ---------------------------------------------------------

BATCH = 24
SAMPLES = 240
PLAN = np.arange(SAMPLES, dtype=np.int64)[::-1].copy()
"""The stream's plan: not the identity, so a row written from the wrong slice shows."""


class StandIn:
    """A worker process as WorkerSet sees it: alive until ``die``."""

    next_pid = 5000

    def __init__(self) -> None:
        StandIn.next_pid += 1
        self.pid = StandIn.next_pid
        self.exitcode: int | None = None

    def die(self) -> None:
        self.exitcode = -9

    def kill(self) -> None:
        self.die()

    def close(self) -> None:
        pass


@dataclass
class FeedStub:
    """The feed a scheduler and a stream use, over a real segment."""

    segment: Segment
    id: int = 0
    name: str = "stub"
    layout: SlotLayout = LAYOUT
    pool: SlotPool = field(default_factory=lambda: SlotPool(SLOTS))
    counters: FeedCounters = field(default_factory=FeedCounters)
    bad: list[tuple[int, str]] = field(default_factory=list)

    @property
    def config(self) -> Any:
        return SimpleNamespace(slots=SLOTS, batch_size=BATCH)

    def note_bad(self, index: int, reason: str) -> None:
        self.bad.append((index, reason))

    def grow_pool(self) -> bool:
        return False  # a full /dev/shm: the pool stays at ``SLOTS``

    def shard_batches(self, world_size: int, remainder: str, offset: int = 0, samples: int = 0) -> int:
        return SAMPLES // BATCH

    def plan(
        self, epoch: int, rank: int, world_size: int, remainder: str, offset: int = 0, order: object = None
    ) -> OrderStub:
        return OrderStub()


class WarmStub:
    """A feed's warm start that has nothing to decode and nothing to give way."""

    def wants_batch(self) -> bool:
        return False

    def drop(self) -> None:
        pass


class OrderStub:
    """``PLAN`` as an epoch order: sliced, or asked for a batch."""

    def __len__(self) -> int:
        return len(PLAN)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return PLAN[rows]

    def batch(self, seq: int, batch_size: int) -> np.ndarray:
        return PLAN[seq * batch_size : (seq + 1) * batch_size]


class Rig:
    """A scheduler with one shard trainer's stream and stand-in workers; ``sent`` is every task."""

    def __init__(
        self, segment: Segment, workers: int = 2, credits: int = 2, board: ProgressBoard | None = None
    ) -> None:
        self.feed = FeedStub(segment)
        self.processes: list[StandIn] = []
        template = WorkerConfig(
            worker=0, parent_pid=1, parent_start="", backend="ipc://unused", feeds=(), log_level="INFO"
        )
        self.workers = WorkerSet(template, workers, spawn=self._spawn)
        for handle in self.workers:
            self.workers.mark_ready(handle, f"w{handle.worker}".encode())
        self.attached = Attachments()
        hello = Hello("t", 1, credits=credits)
        self.session = Session(b"t", "t", hello, 0, 0.0)
        self.stream = self.attached.stream_for(self.session, cast(Feed, self.feed), None)
        self.stream.add(self.session)
        self.stream.on_start("t", 0, 0)
        self.sent: list[tuple[bytes, Task]] = []
        self.delivered: list[Stream] = []
        config = cast(ServiceConfig, SimpleNamespace(strict=False, task_timeout=60.0))
        self.scheduler = Scheduler(
            config,
            self.workers,
            self.attached,
            {0: cast(Any, WarmStub())},
            self._send,
            self.delivered.append,
            board,
        )

    def _spawn(self, cfg: WorkerConfig) -> Any:
        self.processes.append(StandIn())
        return self.processes[-1]

    def _send(self, routing_id: bytes, message: Message) -> None:
        assert isinstance(message, Task)
        self.sent.append((routing_id, decode(encode(message), (Task,))))  # as a worker receives it

    def fill(self, task: Task, bad: frozenset[int] = frozenset()) -> TaskDone:
        """Write ``task`` into its slot as ``fill_slot`` does, skipping ``bad`` samples."""
        row = task.row
        for idx in np.frombuffer(task.indices, "<i8").tolist():
            if idx not in bad:
                write_row(self.feed.segment, task.slot, row, idx)
                row += 1
        reported = tuple((i, "bad") for i in np.frombuffer(task.indices, "<i8").tolist() if i in bad)
        return TaskDone(task.task, 0, row - task.row, reported)

    def report(self, routing_id: bytes, done: TaskDone) -> None:
        handle = next(h for h in self.workers if h.routing_id == routing_id)
        self.scheduler.on_frames(
            [routing_id, encode(TaskDone(done.task, handle.worker, done.count, done.bad))]
        )

    def kill(self, routing_id: bytes) -> None:
        """The worker holding a task dies; its replacement starts and says it is ready."""
        handle = next(h for h in self.workers if h.routing_id == routing_id)
        cast(StandIn, handle.process).die()
        self.scheduler.reap()
        replacement = self.workers.get(handle.worker)
        assert replacement is not None and replacement is not handle
        self.workers.mark_ready(replacement, routing_id)


def indices_of(task: Task) -> list[int]:
    return [int(i) for i in np.frombuffer(task.indices, "<i8")]


@pytest.fixture
def rig(segment: Segment) -> Rig:
    return Rig(segment)


def test_a_first_batch_is_split_across_idle_workers_and_later_ones_stay_whole(segment: Segment) -> None:
    rig = Rig(segment, credits=4)  # twice the workers: later batches need not be cut
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    assert {w0, w1} == {b"w0", b"w1"}
    assert part0.slot == part1.slot and (part0.row, part1.row) == (0, BATCH // 2)
    assert indices_of(part0) + indices_of(part1) == PLAN[:BATCH].tolist()
    assert rig.feed.counters.split_batches == 1 and rig.stream.filling == 1, "one batch, two tasks"

    rig.report(w0, rig.fill(part0))
    assert rig.delivered == [] and rig.feed.pool.state(part0.slot) is SlotState.FILLING
    rig.scheduler.schedule()
    (w, whole) = rig.sent[2]
    assert w == w0 and whole.row == 0 and indices_of(whole) == PLAN[BATCH : 2 * BATCH].tolist(), (
        "the next batch is whole: the first one is already decoding"
    )

    rig.report(w1, rig.fill(part1))
    assert rig.delivered == [rig.stream]
    batch = rig.stream.batches[(rig.stream.gen, 0)]
    assert batch.slot == part0.slot and batch.count == BATCH
    assert rig.feed.pool.state(batch.slot) is SlotState.READY
    assert_rows(rig.feed.segment, batch.slot, PLAN[:BATCH].tolist())
    assert rig.feed.counters.batches == 1 and rig.feed.counters.decoded.total == BATCH


def test_with_credits_under_twice_the_workers_every_batch_is_cut_for_whichever_is_idle_next(
    segment: Segment,
) -> None:
    """2 workers, 2 credits (the 16-core GPU host's 16 workers and 6 credits, small): a batch planned
    when one worker is idle is still cut in two, and the other half waits for the next idle one."""
    rig = Rig(segment, workers=2, credits=2)
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    rig.report(w0, rig.fill(part0))
    rig.scheduler.schedule()
    assert len(rig.sent) == 3 and rig.sent[2][0] == w0
    first_half = rig.sent[2][1]
    assert first_half.row == 0 and indices_of(first_half) == PLAN[BATCH : BATCH + BATCH // 2].tolist()
    rig.report(w1, rig.fill(part1))
    rig.scheduler.schedule()
    (w, second_half) = rig.sent[3]
    assert w == w1 and second_half.row == BATCH // 2 and second_half.slot == first_half.slot
    assert rig.feed.counters.split_batches == 2
    rig.report(w1, rig.fill(second_half))
    rig.report(w0, rig.fill(first_half))
    batch = rig.stream.batches[(rig.stream.gen, 1)]
    assert batch.count == BATCH
    assert_rows(rig.feed.segment, batch.slot, PLAN[BATCH : 2 * BATCH].tolist())


def test_workers_idle_when_a_whole_batch_is_planned_share_it(segment: Segment) -> None:
    """2 workers, 4 credits, 2 slots: batches stay whole by the credits, but when both workers are
    idle and only one batch can be planned (the pool is full), the two share it."""
    rig = Rig(segment, workers=2, credits=4)
    rig.scheduler.schedule()
    for routing_id, task in list(rig.sent):
        rig.report(routing_id, rig.fill(task))
    assert rig.delivered == [rig.stream], "batch 0 is decoded, and the trainer holds it"
    rig.scheduler.schedule()
    second = rig.sent[2:]
    assert {w for w, _ in second} == {b"w0", b"w1"}, "both idle workers took a part"
    assert [t.row for _, t in second] == [0, BATCH // 2]
    assert [i for _, t in second for i in indices_of(t)] == PLAN[BATCH : 2 * BATCH].tolist()
    assert rig.feed.counters.split_batches == 2 and rig.stream.filling == 1
    for routing_id, task in reversed(second):
        rig.report(routing_id, rig.fill(task))
    batch = rig.stream.batches[(rig.stream.gen, 1)]
    assert batch.count == BATCH
    assert_rows(rig.feed.segment, batch.slot, PLAN[BATCH : 2 * BATCH].tolist())


def test_bad_samples_in_several_parts_leave_no_gap(rig: Rig) -> None:
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    bad = frozenset({indices_of(part0)[0], indices_of(part0)[5], indices_of(part1)[3]})
    rig.report(w1, rig.fill(part1, bad))  # the last part first: order of reports does not matter
    rig.report(w0, rig.fill(part0, bad))
    batch = rig.stream.batches[(rig.stream.gen, 0)]
    expected = [i for i in PLAN[:BATCH].tolist() if i not in bad]
    assert batch.count == len(expected) == BATCH - 3
    assert_rows(rig.feed.segment, batch.slot, expected)
    assert sorted(i for i, _ in rig.feed.bad) == sorted(bad)


def test_a_part_whose_worker_died_is_redone_alone(rig: Rig) -> None:
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    rig.kill(w1)
    rig.scheduler.schedule()
    (w, redo) = rig.sent[2]
    assert len(rig.sent) == 3, "only the dead worker's part is redone"
    assert w == w1 and redo.task != part1.task
    assert (redo.slot, redo.row, redo.indices) == (part1.slot, part1.row, part1.indices)
    rig.report(w1, rig.fill(part1))  # the dead worker's late report is not taken for the redo's
    assert rig.delivered == []
    rig.report(w0, rig.fill(part0))
    assert rig.delivered == []
    rig.report(w1, rig.fill(redo))
    batch = rig.stream.batches[(rig.stream.gen, 0)]
    assert batch.count == BATCH
    assert_rows(rig.feed.segment, batch.slot, PLAN[:BATCH].tolist())


def test_a_part_given_up_counts_its_samples_bad_and_the_rest_is_delivered(rig: Rig) -> None:
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    for _ in range(MAX_TASK_ATTEMPTS):
        rig.kill(w1)
        rig.scheduler.schedule()
    redone = [task for _, task in rig.sent[2:] if task.indices == part1.indices]
    assert len(redone) == MAX_TASK_ATTEMPTS - 1 and {t.row for t in redone} == {part1.row}
    assert [i for i, _ in rig.feed.bad] == indices_of(part1)
    assert rig.delivered == [], "part 0 is still decoding"
    rig.report(w0, rig.fill(part0))
    batch = rig.stream.batches[(rig.stream.gen, 0)]
    assert batch.count == BATCH // 2
    assert_rows(rig.feed.segment, batch.slot, indices_of(part0))


def test_the_slot_of_an_abandoned_split_batch_is_freed_once_after_its_last_part(rig: Rig) -> None:
    rig.scheduler.schedule()
    (w0, part0), (w1, part1) = rig.sent
    rig.stream.on_start("t", 3, 0)  # the trainer restarts elsewhere: batch 0 of epoch 0 is abandoned
    rig.report(w0, rig.fill(part0))
    assert rig.feed.pool.state(part0.slot) is SlotState.FILLING, "part 1 may still be writing it"
    rig.report(w1, rig.fill(part1))  # SlotPool refuses a second release, so this frees it once
    assert rig.feed.pool.state(part0.slot) is SlotState.FREE
    assert rig.delivered == [] and rig.stream.batches == {}
    assert rig.feed.counters.batches == 0


# --- a worker waiting on the store (NOTE [ Waiting on the store ]) --------------------------------


@pytest.fixture
def board_rig(segment: Segment, tmp_path: Path) -> Iterator[tuple[Rig, ProgressBoard]]:
    """A rig whose scheduler reads a real progress page, and the page as its workers write it."""
    service_side = ProgressBoard(tmp_path / "progress", 2, create=True)
    workers_side = ProgressBoard(tmp_path / "progress", 2)
    try:
        yield Rig(segment, board=service_side), workers_side
    finally:
        workers_side.close()
        service_side.close()


def handle_of(rig: Rig, routing_id: bytes) -> WorkerHandle:
    return next(h for h in rig.workers if h.routing_id == routing_id)


def test_the_stores_answers_keep_a_worker_from_being_taken_for_hung(
    board_rig: tuple[Rig, ProgressBoard],
) -> None:
    rig, board = board_rig
    rig.scheduler.schedule()
    (w0, part0), _ = rig.sent
    handle = handle_of(rig, w0)
    board.start(handle.worker, part0.task, PREFETCHING)
    rig.scheduler.reap()
    handle.task_since -= 61.0  # a task timeout has passed with no sample finished
    board.answered(handle.worker)  # ... but the store has answered one of its reads since
    rig.scheduler.reap()
    assert handle.process.exitcode is None and handle.killed_at is None, "not killed"
    handle.task_since -= 61.0  # another timeout, and this time nothing at all
    rig.scheduler.reap()
    assert handle.killed_at is not None, "a worker that neither finishes nor hears is killed"


def test_a_worker_that_dies_before_its_first_sample_blames_none(
    board_rig: tuple[Rig, ProgressBoard],
) -> None:
    """Twice dead while its reads were under way (an OOM as the batch's bytes arrive): the part is
    redone whole each time and no sample is reported bad; dead at its first sample twice, that
    sample is bad and the rest is redone without it."""
    rig, board = board_rig
    rig.scheduler.schedule()
    _, (w1, part1) = rig.sent
    for _ in range(2):
        board.start(handle_of(rig, w1).worker, rig.sent[-1][1].task, PREFETCHING)
        rig.kill(w1)
        rig.scheduler.schedule()
        assert rig.sent[-1][1].indices == part1.indices and rig.feed.bad == []
    for _ in range(2):
        board.start(handle_of(rig, w1).worker, rig.sent[-1][1].task, 0)
        rig.kill(w1)
        rig.scheduler.schedule()
    assert [i for i, _ in rig.feed.bad] == indices_of(part1)[:1]
    assert indices_of(rig.sent[-1][1]) == indices_of(part1)[1:]
