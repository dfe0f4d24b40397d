"""Split batches: one batch decoded by several workers at once, each writing its own rows of the slot.

NOTE [ Split batches ]
    A batch is split into parts when workers would otherwise sit idle while it decodes, each part of
    at least ``MIN_PART_ROWS`` samples:

    * a batch its reader is waiting for (none of its producer's plan is decoding, decoded, or held
      by a trainer: a trainer's first batch of a plan that nothing warm served, or the warm start's
      first batch) into up to one part per worker taking tasks, busy or not: the parts are queued
      ahead of any new batch, so whichever worker is idle next takes the next part;
    * any other batch into ``parts_per_batch`` parts, queued likewise, when the trainers' credits
      are fewer than twice the workers: credits bound the batches in flight, not the workers, and
      with such batches kept whole 6 credits kept 5 of a 16-core GPU host's 16 workers busy (its
      trainer waited on data 78-92% of the time). Cut only among the workers idle when a batch
      is planned, a batch planned when one worker was idle took that worker alone for the whole
      batch while the others, done with their parts, waited behind it for credits: 8 of 16 cores;
    * a batch still whole when there are fewer batches to plan than idle workers: the workers idle
      at that moment share the batches planned for them (``share_out``). Where there are as many
      batches to plan as idle workers, each worker takes one whole.

    Part k is the k-th consecutive slice of the plan's indices, decoded by its own task into the
    same slot from its own first row (``Task.row``): the number of samples in the parts before it.

    * The slot stays FILLING (NOTE [ Slot lifecycle ]) until every part has reported: done, or
      given up after its worker died ``MAX_TASK_ATTEMPTS`` times (0 rows, its samples bad). A part
      whose worker died is redone alone under a fresh task id, into its own rows; a task writes
      only rows ``[row, row + len(part))``, so no other part is touched and a late report of the
      dead worker is dropped, as for a whole batch (NOTE [ Worker restarts ]).
    * A part's bad samples leave unwritten rows at the end of its range. Once every part is in,
      the rows of every field and of the indices are moved down, in part order, so that rows
      ``[0, total)`` are contiguous and in plan order, exactly as one worker would have written them.
    * Only then does the producer hear of the batch, once, with the total (``Producer.complete``):
      it counted the batch as one batch filling when it was planned, and frees the slot exactly
      once if the plan was abandoned meanwhile (NOTE [ Plan generations ]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loader_service.decode.contract import SlotViews

MIN_PART_ROWS = 8
"""Fewer samples per task would cost more in messages and waiting than a second worker saves."""

Rows = tuple[int, int]
"""(first row, number of rows)."""


def plan_parts(rows: int, workers: int, min_rows: int = MIN_PART_ROWS) -> list[Rows]:
    """Consecutive ranges covering ``rows``: one per worker at most, each of ``min_rows`` or more
    (a batch too small for two such parts stays whole), sizes differing by at most one."""
    parts = max(1, min(workers, rows // max(1, min_rows)))
    base, extra = divmod(rows, parts)
    ranges = []
    start = 0
    for k in range(parts):
        size = base + (k < extra)
        ranges.append((start, size))
        start += size
    return ranges


def parts_per_batch(workers: int, window: int) -> int:
    """Parts of a batch such that ``workers`` stay busy while trainers may hold ``window`` batches
    in all: about half of those decode at any time (the others are ready or in a trainer's hands),
    so each is cut into ``workers / (window / 2)`` parts, rounded up; 1 where the window is at
    least twice the workers (NOTE [ Split batches ])."""
    if window <= 0:
        return 1
    return max(1, -(-2 * workers // window))


def share_out(batches: int, spare: int) -> list[int]:
    """Extra parts for each of ``batches`` new batches so that ``spare`` idle workers each take
    one: as even as can be, the earlier batches (planned first, wanted first) taking the odd ones."""
    base, extra = divmod(spare, batches)
    return [base + (k < extra) for k in range(batches)]


@dataclass
class SplitBatch:
    """The parts of one split batch and the rows each has written so far."""

    starts: tuple[int, ...]
    """First row of each part, in part order."""
    written: dict[int, int] = field(default_factory=dict)
    """First row -> rows written, for the parts that have reported."""

    def report(self, row: int, count: int) -> bool:
        """Record the part starting at ``row``; True once every part is in."""
        if row not in self.starts or row in self.written:
            raise ValueError(f"part at row {row} reported twice or never planned")
        self.written[row] = count
        return len(self.written) == len(self.starts)

    def runs(self) -> list[Rows]:
        """(first row, rows written) of each part, in part order; every part must have reported."""
        return [(start, self.written[start]) for start in self.starts]


def compact(views: SlotViews, runs: Sequence[Rows]) -> int:
    """Move each run of written rows down to just after the previous one, in every field and the
    indices (NOTE [ Split batches ]); return the rows now valid from 0."""
    total = 0
    for start, count in runs:
        if count and start != total:
            table = () if views.table is None else (views.table,)  # NOTE [ Encoded rows ]
            for array in (*views.fields.values(), views.indices, *table):
                array[total : total + count] = array[start : start + count]  # numpy copes with overlap
        total += count
    return total
