"""Messages between the service and its decode workers (``protocol.messages`` has the rest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from protocol.encoded import MAX_SHARE
from protocol.messages import MAX_BAD_REPORTS, Message
from protocol.schema import (
    OMITTABLE,
    Int,
    ListOf,
    PackedInt64,
    Pair,
    Str,
)


@dataclass(frozen=True)
class WorkerReady(Message):
    KIND: ClassVar[str] = "w_ready"
    worker: Annotated[int, Int(0, 4096)]
    pid: Annotated[int, Int()]


@dataclass(frozen=True)
class Task(Message):
    """Decode the samples ``indices`` (little-endian int64) of ``epoch`` into ``slot`` of ``feed``,
    good ones into consecutive rows from ``row`` on: a whole batch from row 0, one part of a batch
    split across workers from the first row after the parts before it (NOTE [ Split batches ])."""

    KIND: ClassVar[str] = "task"
    task: Annotated[int, Int()]
    feed: Annotated[int, Int(0, 255)]
    slot: Annotated[int, Int(0, 65535)]
    epoch: Annotated[int, Int()]
    indices: Annotated[bytes, PackedInt64(65536)]
    row: Annotated[int, Int(0, 65535), OMITTABLE] = 0
    encode: Annotated[int, Int(0, MAX_SHARE), OMITTABLE] = 0
    """Thousandths of the task's samples to leave encoded where they can be (NOTE [ Encoded rows ]):
    which ones, ``encoded_rows`` says."""


@dataclass(frozen=True)
class TaskDone(Message):
    """Rows ``[row, row + count)`` of the task's slot are written (``Task.row``); ``bad`` lists (index,
    reason) of skipped files. ``retry``, when set, says why nothing was done and the task must be done
    again later (the data's store did not answer: NOTE [ Object store reads ])."""

    KIND: ClassVar[str] = "done"
    task: Annotated[int, Int()]
    worker: Annotated[int, Int(0, 4096)]
    count: Annotated[int, Int(0, 65536)]
    bad: Annotated[tuple[tuple[int, str], ...], ListOf(Pair(Int(), Str()), MAX_BAD_REPORTS)] = ()
    retry: Annotated[str, Str(), OMITTABLE] = ""
    encoded: Annotated[int, Int(0, 65536), OMITTABLE] = 0
    """Of the ``count`` rows, how many were left encoded."""


@dataclass(frozen=True)
class StopWorker(Message):
    KIND: ClassVar[str] = "stop"
