"""Which samples make up batch ``seq`` of ``epoch``: a pure function of (seed, epoch).

Because nothing here depends on process, worker or timing, two services started with the same data
and seed produce the same batches, and a restarted trainer can continue an epoch by position alone.

NOTE [ Epoch order without a permutation ]
    The service's main loop plans every batch, so nothing it calls per epoch may cost O(samples):
    shuffling a 1.28M-sample index takes tens of milliseconds and keeping a rank's copy of it 10 MB
    per stream. The order is instead a keyed permutation that maps a *position* in the epoch to a
    sample index on demand: a Feistel network on the square grid ``[0, a) x [0, a)`` with
    ``a = ceil(sqrt(samples))``. Position ``x`` is the cell ``(x // a, x % a)``; each round replaces
    ``(L, R)`` by ``(R, (L + F_i[R]) mod a)``, a bijection of the grid whatever ``F_i`` is, so the
    network permutes ``[0, a*a)``. The round functions are tables of ``a`` random draws from
    ``SeedSequence([seed, epoch, ...])``: a Feistel network with truly random round functions, so
    the order has no structure a training run could notice (tests/unit/test_sampler.py checks), and
    a round costs three numpy calls. The tables are O(sqrt(samples)) (36 KB at 1.28M samples), made
    once per epoch and shared by every stream in that epoch; a stream keeps only a reference.
    The grid holds fewer than ``2a + 1`` cells beyond ``samples``; a position that lands on one goes
    through the network again until it lands inside (cycle walking), which stays a bijection of
    ``[0, samples)`` because the walk follows the position's own cycle. About one position in
    ``sqrt(samples) / 2`` walks, so a batch costs a fixed handful of numpy calls on ``batch_size``
    elements, whatever the epoch's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import isqrt
from typing import Protocol

import numpy as np
import numpy.typing as npt

from protocol.shares import batches_per_epoch, shard_size

ROUNDS = 8
"""Feistel rounds, a few microseconds each for a batch of 64. Six already look random on large
grids; on the tiny grids of a few samples, six still favour some positions measurably and eight do
not."""
_ORDER_TAG = 0x5EED


@dataclass(frozen=True, eq=False)
class EpochOrder:
    """The order of ``samples`` samples in one epoch, as a function of position.

    See NOTE [ Epoch order without a permutation ].
    """

    samples: int
    side: int
    """``a``: the grid is ``side * side`` cells, the first ``samples`` of them real positions."""
    rounds: npt.NDArray[np.int32]
    """``ROUNDS x side`` table: ``rounds[i, R]`` is round ``i``'s function at ``R``."""

    @classmethod
    def of(cls, seed: int, epoch: int, samples: int) -> EpochOrder:
        if samples < 1:
            raise ValueError(f"an epoch needs at least one sample, not {samples}")
        side = isqrt(samples - 1) + 1
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _ORDER_TAG])))
        rounds = rng.integers(0, side, size=(ROUNDS, side), dtype=np.int32)
        rounds.setflags(write=False)
        return cls(samples, side, rounds)

    def at(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The samples at ``positions`` (each in ``[0, samples)``) of the epoch."""
        cells = self._network(positions)
        outside = np.flatnonzero(cells >= self.samples)
        while outside.size:  # cycle walking; rare, see the NOTE
            cells[outside] = self._network(cells[outside])
            outside = outside[cells[outside] >= self.samples]
        return cells

    def _network(self, cells: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        side = self.side
        left, right = np.divmod(cells.astype(np.int64, copy=False), side)
        for table in self.rounds:
            left, right = right, (left + table[right]) % side
        result: npt.NDArray[np.int64] = left * side + right
        return result


@lru_cache(maxsize=64)
def epoch_order(seed: int, epoch: int, samples: int) -> EpochOrder:
    """The epoch's order; cached because deriving its round keys costs tens of microseconds."""
    return EpochOrder.of(seed, epoch, samples)


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, samples: int) -> npt.NDArray[np.int64]:
    """The whole order of ``epoch`` as an array, for code that walks it (a DataLoader's sampler).

    The service never builds it (NOTE [ Epoch order without a permutation ]); this is the same order.
    """
    perm = epoch_order(seed, epoch, samples).at(np.arange(samples, dtype=np.int64))
    perm.setflags(write=False)
    return perm


class Order(Protocol):
    """An epoch's order by position: ``EpochOrder``, or a mixture's (``mixture.MixtureEpoch``)."""

    @property
    def samples(self) -> int: ...

    def at(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...


@dataclass(frozen=True)
class ShardOrder:
    """Rank ``rank``'s samples of an epoch, in order: every ``world_size``-th of the epoch order.

    ``pad`` repeats the epoch's first samples to fill the last round (as DistributedSampler does
    without drop_last); ``drop`` leaves out the last ``samples % world_size``. A pure function of
    its fields, so ranks on different hosts agree without talking to each other. Holds no arrays:
    each batch is computed when it is planned.
    """

    epoch: Order
    rank: int
    world_size: int
    size: int
    """Samples of this shard: ``shard_size(samples - offset, world_size, remainder)``."""
    offset: int = 0
    """Where the shared-out part of the epoch begins: positions before it were taken by an earlier
    job (NOTE [ Elastic epochs ] in protocol/shares.py)."""

    def __len__(self) -> int:
        return self.size

    def indices(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Samples at shard positions ``[start, stop)`` (clipped to the shard)."""
        start, stop, step = max(start, 0), min(stop, self.size), self.world_size
        positions = np.arange(start * step + self.rank, stop * step + self.rank, step, dtype=np.int64)
        rest = self.epoch.samples - self.offset
        if positions.size and positions[-1] >= rest:
            positions %= rest  # pad: the last round wraps to the start of the shared-out part
        return self.epoch.at(positions + self.offset)

    def batch(self, seq: int, batch_size: int) -> npt.NDArray[np.int64]:
        """Batch ``seq``: the shard's ``seq``-th run of ``batch_size`` (the last may be short)."""
        n = batches_per_epoch(self.size, batch_size)
        if not 0 <= seq < n:
            raise ValueError(f"batch {seq} outside epoch of {n} batches")
        return self.indices(seq * batch_size, (seq + 1) * batch_size)


def shard_order(
    seed: int, epoch: int, samples: int, rank: int, world_size: int, remainder: str, offset: int = 0
) -> ShardOrder:
    """Rank ``rank``'s order of ``epoch`` from position ``offset`` on (see ShardOrder); O(1) to make
    once the epoch's keys are cached."""
    if not 0 <= offset < samples:
        raise ValueError(f"an epoch of {samples} samples cannot resume at position {offset}")
    size = shard_size(samples - offset, world_size, remainder)
    return ShardOrder(epoch_order(seed, epoch, samples), rank, world_size, size, offset)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Augmentation randomness for one sample: the same whichever worker decodes it."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA06])))
