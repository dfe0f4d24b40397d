"""How an epoch is shared among the ranks of a job: pure arithmetic the service and trainers agree on.

NOTE [ Elastic epochs ]
    In shard mode rank ``r`` of ``w`` takes every ``w``-th position of the epoch's order, and the
    ranks of a job step together, so after each has taken ``k`` batches of ``b`` the job has
    consumed exactly the first ``k * b * w`` positions of the order: a prefix, whatever ``w`` is. A
    trainer's state therefore names that prefix (``consumed``), not its rank or position, and any
    rank's state resumes every rank of a job of any size: the resumed epoch shares out what
    follows the prefix (``offset``) by the new job's ranks and ``remainder``, so across the runs
    each sample of the epoch is taken once (``pad`` repeats a few of the suffix's first ones, as it
    repeats the epoch's first ones, to even the ranks out; ``drop`` leaves out the last few).
"""

from __future__ import annotations


def batches_per_epoch(samples: int, batch_size: int) -> int:
    """Every sample once; the last batch holds the remainder (it may be smaller)."""
    return -(-samples // batch_size)


def shard_size(samples: int, world_size: int, remainder: str) -> int:
    """Samples per rank: the same for every rank, so every DDP rank runs as many steps."""
    return samples // world_size if remainder == "drop" else -(-samples // world_size)


def rank_batches(samples: int, batch_size: int, world_size: int, remainder: str, offset: int = 0) -> int:
    """Batches of each rank's share of an epoch that begins at position ``offset`` of its order."""
    return batches_per_epoch(shard_size(samples - offset, world_size, remainder), batch_size)


def consumed(offset: int, position: int, batch_size: int, world_size: int, samples: int) -> int:
    """Positions of the epoch's order a job has taken after ``position`` batches of every rank,
    from ``offset`` on (NOTE [ Elastic epochs ]); at most the epoch."""
    return min(samples, offset + position * batch_size * world_size)
