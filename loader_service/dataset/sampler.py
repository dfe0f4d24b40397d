"""Which samples make up batch ``seq`` of ``epoch``: a pure function of (seed, epoch).

Because nothing here depends on process, worker or timing, two services started with the same data
and seed produce the same batches, and a restarted trainer can continue an epoch by position alone.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt


def batches_per_epoch(samples: int, batch_size: int) -> int:
    """Every sample once; the last batch holds the remainder (it may be smaller)."""
    return -(-samples // batch_size)


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, samples: int) -> npt.NDArray[np.int64]:
    """The order of samples in ``epoch``; cached because every batch of an epoch slices it."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x5EED])))
    perm = rng.permutation(samples).astype(np.int64)
    perm.setflags(write=False)
    return perm


def batch_of(plan: npt.NDArray[np.int64], seq: int, batch_size: int) -> npt.NDArray[np.int64]:
    """Batch ``seq`` of an epoch plan: its ``seq``-th slice of ``batch_size`` (the last may be short)."""
    n = batches_per_epoch(len(plan), batch_size)
    if not 0 <= seq < n:
        raise ValueError(f"batch {seq} outside epoch of {n} batches")
    return plan[seq * batch_size : (seq + 1) * batch_size]


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Augmentation randomness for one sample: the same whichever worker decodes it."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA06])))


def shard_size(samples: int, world_size: int, remainder: str) -> int:
    """Samples per rank per epoch: the same for every rank, so every DDP rank runs as many steps."""
    return samples // world_size if remainder == "drop" else -(-samples // world_size)


@lru_cache(maxsize=16)
def shard_plan(
    seed: int, epoch: int, samples: int, rank: int, world_size: int, remainder: str
) -> npt.NDArray[np.int64]:
    """Rank ``rank``'s samples of ``epoch``, in order: every ``world_size``-th of the permutation.

    ``pad`` repeats the permutation's first samples to fill the last round (as DistributedSampler
    does without drop_last); ``drop`` leaves out the last ``samples % world_size``. A pure function of
    its arguments, so ranks on different hosts agree without talking to each other.
    """
    perm = epoch_permutation(seed, epoch, samples)
    total = shard_size(samples, world_size, remainder) * world_size
    if total > samples:
        perm = np.resize(perm, total)  # np.resize repeats from the start
    plan = np.ascontiguousarray(perm[rank:total:world_size])
    plan.setflags(write=False)
    return plan
