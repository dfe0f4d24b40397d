"""Decode tasks: which batch each idle worker decodes next, and what happens to its report or its death.

A task is one batch of one producer (a stream or a cache, ``producers.py``) in one slot, or one part
of a batch split across workers (NOTE [ Split batches ]). The task carries the
producer itself, so a worker's report goes straight back to it (NOTE [ Plan generations ]); a task
whose worker died is redone under a fresh id (NOTE [ Worker restarts ]).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from loader_service.config import ServiceConfig
from loader_service.decode.contract import slot_views
from loader_service.decode.progress import PREFETCHING, ProgressBoard
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.early import EarlyBatches
from loader_service.supervisor.streams.producers import Lane, Producer
from loader_service.supervisor.streams.shard import ShardStream
from loader_service.supervisor.streams.stream import Stream
from loader_service.supervisor.trainers.attachments import Attachments
from loader_service.supervisor.workers.parts import (
    SplitBatch,
    compact,
    parts_per_batch,
    plan_parts,
    share_out,
)
from loader_service.supervisor.workers.pool import WorkerHandle, WorkerSet
from protocol.codec import decode
from protocol.messages import Message, ProtocolError
from protocol.workers import Task, TaskDone, WorkerReady

log = logging.getLogger(__name__)
MAX_TASK_ATTEMPTS = 3
"""Tries of a task whose worker died before finishing any sample of it (NOTE [ Per-sample progress ])."""
CRASHES_PER_SAMPLE = 2
"""Deaths of a worker on one sample after which that sample is bad: the first may be the machine's."""
MAX_SUSPECTS = 10_000
MAX_STORE_WAITS = 90
"""Tries of a task whose reads the data's store kept failing, before its samples are given up."""
STORE_WARNING_INTERVAL = 10.0
WORKER_MESSAGES = (WorkerReady, TaskDone)


@dataclass(frozen=True)
class TaskRecord:
    task: int
    producer: Producer
    gen: int
    seq: int
    epoch: int
    """Of the plan at planning time: a cache may move on to another epoch while its batch decodes."""
    slot: int
    indices: bytes
    attempts: int = 0
    row: int = 0
    """The first row this task writes: 0, or where its part starts (NOTE [ Split batches ])."""
    split: SplitBatch | None = None
    """The batch this task is one part of, if split."""
    waits: int = 0
    """Times a worker handed it back because the data's store did not answer (``TaskDone.retry``)."""
    encode: int = 0
    """Thousandths of its samples to leave encoded for the trainer (NOTE [ Encoded rows ])."""

    @property
    def feed(self) -> Feed:
        return self.producer.feed


class Scheduler:
    def __init__(
        self,
        config: ServiceConfig,
        workers: WorkerSet,
        attached: Attachments,
        warm: dict[int, EarlyBatches],
        send_worker: Callable[[bytes, Message], None],
        deliver: Callable[[Stream], None],
        progress: ProgressBoard | None = None,
    ) -> None:
        self._config = config
        self._workers = workers
        self._attached = attached
        self._warm = warm
        self._send_worker = send_worker
        self._deliver = deliver
        self._tasks: dict[int, TaskRecord] = {}
        self._redo: deque[TaskRecord] = deque()
        self._store_quiet_until = 0.0
        """Until when the store's silence is not logged again."""
        self._parts: deque[TaskRecord] = deque()
        """Parts of split batches no worker has taken yet (NOTE [ Split batches ])."""
        self._next_task = 0
        self._progress = progress
        self._suspects: dict[tuple[int, int], int] = {}
        """(feed, sample) -> deaths of a worker while decoding it (NOTE [ Per-sample progress ])."""
        self.fatal: str | None = None
        """Why the service must stop: ``--strict`` met a bad file, or workers cannot start."""

    # --- worker reports -------------------------------------------------------------------------

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames[-1], WORKER_MESSAGES)
        except ProtocolError as exc:
            log.error("bad message from a decode worker: %s", exc)
            return
        if isinstance(msg, WorkerReady):
            self._workers.on_ready(msg.worker, msg.pid, frames[0])
        elif isinstance(msg, TaskDone):
            self._on_task_done(msg)

    def _on_task_done(self, msg: TaskDone) -> None:
        handle = self._workers.get(msg.worker)
        if handle is not None and handle.task == msg.task:
            handle.on_tasks += time.monotonic() - handle.task_started
            handle.task = None
            handle.decoded.add(msg.count)
        record = self._tasks.pop(msg.task, None)
        if record is None:
            return  # a report from before a redo (NOTE [ Worker restarts ])
        if msg.retry:
            self._retry_later(record, msg.retry)
            return
        if record.split is not None:
            log.debug(
                "feed %s: batch %d of epoch %d (%s): part from row %d, %d rows by worker %d",
                record.feed.name,
                record.seq,
                record.epoch,
                record.producer.lane.value,
                record.row,
                msg.count,
                msg.worker,
            )
        record.feed.counters.encoded += msg.encoded
        self._complete(record, msg.count, msg.bad)

    def _complete(self, record: TaskRecord, count: int, bad: tuple[tuple[int, str], ...]) -> None:
        feed = record.feed
        for idx, reason in bad:
            self._report_bad(feed, idx, reason)
        feed.counters.decoded.add(count)
        if record.producer.lane is Lane.WARM:
            feed.counters.warm_decoded += count
        if record.split is not None:
            if not record.split.report(record.row, count):
                return  # NOTE [ Split batches ]: the batch is complete when its last part is in
            views = slot_views(feed.segment, feed.layout, record.slot, feed.config.slots)
            count = compact(views, record.split.runs())
        receiver = record.producer.complete(record.gen, record.seq, record.slot, count)
        if isinstance(receiver, Stream):
            self._deliver(receiver)

    def _retry_later(self, record: TaskRecord, reason: str) -> None:
        """NOTE [ Object store reads ]: the worker waited out its read deadline on the store; the task
        goes back in line whole, under a fresh id. Only a store silent for ``MAX_STORE_WAITS`` tries
        in a row (a quarter of an hour at the default deadline) costs the batch's samples."""
        waits = record.waits + 1
        record.feed.counters.store_waits += 1
        if waits >= MAX_STORE_WAITS:
            why = f"the data's store did not answer {waits} times in a row: {reason}"
            self._complete(record, 0, tuple((i, why) for i in np.frombuffer(record.indices, "<i8").tolist()))
            return
        now = time.monotonic()
        if now >= self._store_quiet_until:
            self._store_quiet_until = now + STORE_WARNING_INTERVAL
            log.warning(
                "feed %s: the data's store does not answer (%s); batches wait", record.feed.name, reason
            )
        self._next_task += 1
        self._redo.append(replace(record, task=self._next_task, waits=waits))

    def _report_bad(self, feed: Feed, idx: int, reason: str) -> None:
        feed.note_bad(idx, reason)
        if self._config.strict and self.fatal is None:
            where = feed.sources.relpath(idx) if 0 <= idx < len(feed.sources) else f"sample {idx}"
            self.fatal = f"--strict: feed {feed.name!r}: {where}: {reason}"

    # --- worker deaths --------------------------------------------------------------------------

    def reap(self) -> None:
        """Replace dead or lost workers and redo their tasks (NOTE [ Worker restarts ])."""
        now = time.monotonic()
        self._note_progress(now)
        for lost in self._workers.check_stuck(now, self._config.task_timeout):
            self._redo_task(lost.task, self._died_on(lost), hung=True)
        for dead in self._workers.reap(now):
            self._redo_task(dead.task, self._died_on(dead), hung=dead.killed_at is not None)
        if self._workers.given_up and self.fatal is None:
            self.fatal = "decode workers keep failing at start-up; see their errors above"

    def _note_progress(self, now: float) -> None:
        """A worker that finished a sample since the last look, or heard from the data's store, has
        its task timeout started again (NOTE [ Waiting on the store ])."""
        if self._progress is None:
            return
        for h in self._workers:
            answers = self._progress.answers(h.worker)
            heard, h.answers = answers != h.answers, answers
            if h.task is None:
                continue
            task, done = self._progress.read(h.worker)
            if task == h.task and done != h.samples_done:
                h.samples_done, h.task_since = done, now
            elif heard:
                h.task_since = now

    def _died_on(self, handle: WorkerHandle) -> int | None:
        """How many samples of its task the worker had finished, if it said (NOTE [ Per-sample
        progress ]); the next one is the sample it died on."""
        if self._progress is None or handle.task is None:
            return None
        task, done = self._progress.read(handle.worker)
        return done if task == handle.task and done != PREFETCHING else None

    def _redo_task(self, task: int | None, done: int | None, hung: bool) -> None:
        record = self._tasks.pop(task, None) if task is not None else None
        if record is None:
            return
        # The slot stays FILLING and is rewritten from scratch by whoever takes the redo. A fresh
        # task id makes a late ``done`` from the dead worker unrecognisable, so the slot can never
        # be announced while the redo is still writing it.
        self._next_task += 1
        indices = np.frombuffer(record.indices, dtype="<i8")
        if done is not None and done < len(indices):
            redo = self._without_culprit(record, indices, done, hung)
        else:  # it died before saying where: the whole task again, a few times at most
            redo = replace(record, attempts=record.attempts + 1)
            if redo.attempts >= MAX_TASK_ATTEMPTS:
                self._give_up(redo)
                return
        self._redo.append(replace(redo, task=self._next_task))

    def _without_culprit(
        self, record: TaskRecord, indices: npt.NDArray[np.int64], done: int, hung: bool
    ) -> TaskRecord:
        """NOTE [ Per-sample progress ]: the task again, without the sample its worker died on once
        that sample is proven bad (a hang, or a second crash)."""
        culprit = int(indices[done])
        key = (record.feed.id, culprit)
        deaths = self._suspects[key] = self._suspects.get(key, 0) + 1
        if not hung and deaths < CRASHES_PER_SAMPLE:
            return record
        del self._suspects[key]
        if len(self._suspects) > MAX_SUSPECTS:
            self._suspects.clear()
        why = (
            f"its decode worker finished nothing for over {self._config.task_timeout:.0f} s (--task-timeout)"
            if hung
            else f"its decode worker died {deaths} times on it"
        )
        self._report_bad(record.feed, culprit, why)
        rest = np.delete(indices, done).astype("<i8", copy=False)
        return replace(record, indices=rest.tobytes())

    def _give_up(self, record: TaskRecord) -> None:
        """A batch (or part) that killed its decoder every time: report its files bad and deliver it
        without them."""
        reason = f"decode worker died {record.attempts} times on the batch holding this file"
        indices = np.frombuffer(record.indices, dtype="<i8").tolist()
        self._complete(record, 0, tuple((i, reason) for i in indices))

    # --- handing out tasks ----------------------------------------------------------------------

    def schedule(self) -> None:
        idle = self._workers.idle()
        records: list[TaskRecord] = []
        fresh: list[int] = []
        """Positions in ``records`` of batches planned whole just now: what the idle workers share."""
        while len(records) < len(idle):
            record, planned = self._next_record()
            if record is None:
                break
            if planned and record.split is None:
                fresh.append(len(records))
            records.append(record)
        records += self._share(records, fresh, len(idle) - len(records))
        for handle, record in zip(idle, records, strict=False):  # fewer tasks than workers: some idle
            assert handle.routing_id is not None
            now = time.monotonic()
            handle.task, handle.samples_done = record.task, 0
            handle.task_since = handle.task_started = now
            self._tasks[record.task] = record
            task = Task(
                record.task,
                record.feed.id,
                record.slot,
                record.epoch,
                record.indices,
                record.row,
                record.encode,
            )
            self._send_worker(handle.routing_id, task)

    def _share(self, records: list[TaskRecord], fresh: list[int], spare: int) -> list[TaskRecord]:
        """NOTE [ Split batches ]: the batches planned whole for this round split among the
        ``spare`` workers that would otherwise stay idle; each first part replaces its batch in
        ``records``, and the other parts are returned, one per spare worker at most."""
        if spare <= 0 or not fresh:
            return []
        rest: list[TaskRecord] = []
        for position, parts in zip(fresh, share_out(len(fresh), spare), strict=True):
            first, *others = self._split(records[position], parts + 1)
            records[position] = first
            rest += others
        return rest

    def _next_record(self) -> tuple[TaskRecord | None, bool]:
        """Redone tasks first, then the parts of split batches, then a new batch; and whether it
        is a batch planned now."""
        if self._redo:
            return self._redo.popleft(), False
        if self._parts:
            return self._parts.popleft(), False
        return self._next_job(), True

    def _next_job(self) -> TaskRecord | None:
        """The next batch to decode: for the stream with the fewest batches in flight (the trainer
        closest to waiting: with DDP ranks sharing a pool smaller than their credits, the rank that is
        behind must not be starved by the prefetch of ranks blocked in an all-reduce); then the next
        epoch's first batches; warm-start batches last. Ties go round-robin."""
        order = self._attached.order
        streams = self._attached.streams
        order.rotate(-1)
        wanting = [streams[key] for key in order if streams[key].wants_batch()]
        for stream in sorted(wanting, key=lambda s: s.in_flight):
            if not stream.feed.pool.free and not stream.feed.grow_pool():
                self._warm[stream.feed.id].drop()  # NOTE [ Warm start ]: a trainer's batch goes first
            if not stream.feed.pool.free and isinstance(stream, ShardStream) and stream.picked:
                stream.drop_kept()  # NOTE [ Kept batches ]: a batch asked for goes before them
                if stream.ahead is not None:
                    stream.ahead.drop()  # and before its guess ahead
            if stream.feed.pool.free:
                return self._plan(stream)
        for key in order:
            ahead = streams[key].ahead
            if ahead is not None and streams[key].wants_ahead() and ahead.feed.pool.free:
                return self._plan(ahead)
        for warm in self._warm.values():
            if warm.wants_batch() and warm.feed.pool.free:
                return self._plan(warm)
        return None

    def _plan(self, producer: Producer) -> TaskRecord:
        """Plan the producer's next batch: one task, or its first part with the others queued ahead
        of any new batch (NOTE [ Split batches ])."""
        slot = producer.feed.pool.acquire()
        assert slot is not None
        waited = waited_for(producer)  # asked before planning counts the batch as filling
        gen, seq, planned = producer.plan_batch()
        self._next_task += 1
        indices = planned.astype("<i8", copy=False).tobytes()
        encode = producer.encode_share()
        if encode and not producer.feed.pool.room(slot):
            encode = 0  # /dev/shm holds no room for its encoded rows: decoded whole (SlotPool.room)
        record = TaskRecord(self._next_task, producer, gen, seq, producer.epoch, slot, indices, encode=encode)
        # Every worker taking tasks counts, even one still starting: parts go to whichever worker
        # is idle next; parked ones take none (NOTE [ Sizing workers ]).
        active = self._workers.active
        window = sum(stream.window for stream in self._attached.streams.values())
        first, *others = self._split(record, active if waited else parts_per_batch(active, window))
        self._parts.extend(others)
        return first

    def _split(self, record: TaskRecord, workers: int) -> list[TaskRecord]:
        """The whole batch ``record`` as up to ``workers`` parts; itself alone if too small to split."""
        indices = np.frombuffer(record.indices, dtype="<i8")
        ranges = plan_parts(len(indices), workers)
        if len(ranges) == 1:
            return [record]
        split = SplitBatch(tuple(start for start, _ in ranges))
        tasks = [record.task, *range(self._next_task + 1, self._next_task + len(ranges))]
        self._next_task += len(ranges) - 1
        parts = [
            replace(
                record, task=task, indices=indices[start : start + rows].tobytes(), row=start, split=split
            )
            for task, (start, rows) in zip(tasks, ranges, strict=True)
        ]
        record.feed.counters.split_batches += 1
        log.debug(
            "feed %s: batch %d of epoch %d split into %d parts (%s)",
            record.feed.name,
            record.seq,
            record.epoch,
            len(ranges),
            record.producer.lane.value,
        )
        return parts


def waited_for(producer: Producer) -> bool:
    """Will the producer's reader wait for its next batch (NOTE [ Split batches ])? True when none
    of its plan is decoding, decoded, or held by a trainer: a trainer that holds a batch is busy
    with it, and splitting its next one would only add tasks."""
    if producer.filling or producer.lane is Lane.AHEAD:
        return False  # a next epoch's first batches: planned while the trainer still holds batches
    if isinstance(producer, EarlyBatches):
        return not producer.ready
    if isinstance(producer, Stream):
        return not any(gen == producer.gen for gen, _seq in producer.batches)
    return False
