from __future__ import annotations

import numpy as np
import pytest

from loader_service.dataset.sampler import (
    EpochOrder,
    batches_per_epoch,
    epoch_order,
    epoch_permutation,
    sample_rng,
    shard_order,
    shard_size,
)
from protocol.shares import consumed, rank_batches


def whole(seed: int, epoch: int, samples: int, rank: int, world: int, remainder: str) -> list[int]:
    """A rank's whole shard, batch after batch, as the service plans it."""
    order = shard_order(seed, epoch, samples, rank, world, remainder)
    return [i for seq in range(batches_per_epoch(len(order), 5)) for i in order.batch(seq, 5).tolist()]


@pytest.mark.parametrize("samples", [1, 2, 3, 7, 64, 65, 1000, 2**20 + 1])
def test_the_order_is_a_permutation_of_the_samples(samples: int) -> None:
    perm = epoch_permutation(4, 1, samples)
    assert perm.dtype == np.int64
    assert np.array_equal(np.sort(perm), np.arange(samples))


def test_the_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = epoch_permutation(1, 0, 1000)
    epoch_permutation.cache_clear()
    epoch_order.cache_clear()
    assert np.array_equal(a, epoch_permutation(1, 0, 1000))
    assert np.array_equal(a, EpochOrder.of(1, 0, 1000).at(np.arange(1000)))
    assert not np.array_equal(a, epoch_permutation(1, 1, 1000))
    assert not np.array_equal(a, epoch_permutation(2, 0, 1000))


def test_any_positions_give_the_samples_the_whole_order_has_there() -> None:
    n = 2**16 + 3
    order, perm = epoch_order(6, 2, n), epoch_permutation(6, 2, n)
    positions = np.array([n - 1, 0, 12345, 7, n - 2], dtype=np.int64)
    assert order.at(positions).tolist() == perm[positions].tolist()


def test_batches_cover_the_epoch_once_with_a_short_last_batch() -> None:
    n, b = 103, 10
    assert batches_per_epoch(n, b) == 11
    order = shard_order(5, 3, n, 0, 1, "pad")
    parts = [order.batch(s, b) for s in range(11)]
    assert [len(p) for p in parts] == [10] * 10 + [3]
    assert np.concatenate(parts).tolist() == epoch_permutation(5, 3, n).tolist()
    with pytest.raises(ValueError):
        order.batch(11, b)
    with pytest.raises(ValueError):
        order.batch(-1, b)


def test_sample_randomness_depends_on_sample_not_order() -> None:
    assert sample_rng(0, 1, 42).random() == sample_rng(0, 1, 42).random()
    assert sample_rng(0, 1, 42).random() != sample_rng(0, 2, 42).random()
    assert sample_rng(0, 1, 42).random() != sample_rng(0, 1, 43).random()


@pytest.mark.parametrize(("samples", "world"), [(10, 4), (12, 4), (7, 3), (3, 8), (1000, 7), (1, 2)])
def test_shards_are_disjoint_equal_and_cover_the_epoch(samples: int, world: int) -> None:
    perm = epoch_permutation(9, 2, samples).tolist()
    for remainder in ("pad", "drop"):
        shards = [whole(9, 2, samples, r, world, remainder) for r in range(world)]
        assert len({len(s) for s in shards}) == 1, "equal steps on every rank"
        assert len(shards[0]) == shard_size(samples, world, remainder)
        together = [i for s in shards for i in s]
        if remainder == "drop":
            assert len(set(together)) == len(together) == samples - samples % world
        else:
            assert set(together) == set(range(samples))
            assert len(together) - samples == (-samples) % world
    # rank r takes every world-th position of the epoch, as DistributedSampler does; pad wraps
    total = shard_size(samples, world, "pad") * world
    for r in range(world):
        assert whole(9, 2, samples, r, world, "drop") == perm[: samples - samples % world][r::world]
        assert whole(9, 2, samples, r, world, "pad") == [perm[p % samples] for p in range(r, total, world)]


def test_a_stream_keeps_no_samples() -> None:
    """NOTE [ Epoch order without a permutation ]: a shard holds the epoch's tables, not its samples."""
    n = 1_281_167
    order = shard_order(0, 0, n, 3, 8, "pad")
    assert order.epoch.rounds.nbytes < 64 * 1024
    assert order.epoch is shard_order(0, 0, n, 5, 8, "pad").epoch, "one epoch's tables for every rank"
    assert len(order.batch(0, 64)) == 64


# --- the shuffle shows no structure ------------------------------------------------------------------
# Fixed seeds throughout: each check is deterministic, with bounds far (>5 sigma) from what a uniformly
# random permutation gives, and far from what a structured order (identity, stride, blocks) gives.


def test_neighbouring_positions_hold_unrelated_samples() -> None:
    n = 2**16 + 1
    perm = epoch_permutation(11, 0, n).astype(float)
    # uniformly random: correlations about N(0, 1/sqrt(n)) = N(0, 0.004)
    assert abs(np.corrcoef(perm[:-1], perm[1:])[0, 1]) < 0.03
    assert abs(np.corrcoef(np.arange(n), perm)[0, 1]) < 0.03
    # where neighbouring samples land: the inverse order must not keep them together either
    where = np.argsort(perm).astype(float)
    assert abs(np.corrcoef(where[:-1], where[1:])[0, 1]) < 0.03
    # steps between neighbours: a random order has |step| <= 10 for about 20/n of them (~20 here)
    assert np.count_nonzero(np.abs(np.diff(perm)) <= 10) < 100


@pytest.mark.parametrize("samples", [10, 1000])
def test_a_samples_position_is_uniform_across_seeds(samples: int) -> None:
    seeds, bins = 4000, 10
    first = np.array([EpochOrder.of(seed, 0, samples).at(np.arange(samples)) for seed in range(seeds)])
    for sample in (0, samples // 2, samples - 1):
        position = np.argmax(first == sample, axis=1)
        counts = np.bincount(position * bins // samples, minlength=bins)
        expected = seeds / bins
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 40, f"sample {sample}: positions {counts.tolist()}"  # 9 dof: p < 1e-5 beyond 40


def test_different_epochs_are_unrelated_orders() -> None:
    n = 10_000
    a, b = epoch_permutation(3, 0, n).astype(float), epoch_permutation(3, 1, n).astype(float)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
    assert np.count_nonzero(a == b) < 20  # a random pair agrees at about one position


# --- NOTE [ Elastic epochs ] -----------------------------------------------------------------------


def job_takes(samples: int, world: int, remainder: str, batches: int, offset: int = 0) -> list[int]:
    """What a job of ``world`` ranks stepping together takes in ``batches`` steps (all if -1)."""
    ranks = [shard_order(3, 1, samples, r, world, remainder, offset) for r in range(world)]
    total = batches_per_epoch(len(ranks[0]), BATCH) if batches < 0 else batches
    return [int(i) for seq in range(total) for order in ranks for i in order.batch(seq, BATCH)]


BATCH = 4


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1), (1, 4), (5, 5)])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_a_job_resumed_at_any_world_size_takes_the_rest_of_the_epoch_once(
    before: int, after: int, steps: int
) -> None:
    """A job of ``before`` ranks takes ``steps`` batches each; its state names the prefix it took;
    a job of ``after`` ranks (remainder drop) takes what follows: every sample once, except the
    last few the drop leaves out, and nothing of the first job's prefix again."""
    samples = 97
    steps = min(steps, rank_batches(samples, BATCH, before, "pad") - 1)  # mid-epoch, as a checkpoint is
    first = job_takes(samples, before, "pad", steps)
    taken = consumed(0, steps, BATCH, before, samples)
    assert sorted(first) == sorted(epoch_permutation(3, 1, samples)[:taken].tolist())
    rest = job_takes(samples, after, "drop", -1, taken)
    order = epoch_permutation(3, 1, samples).tolist()
    left_out = (samples - taken) % after
    assert sorted(first + rest) == sorted(order[: samples - left_out]), "each once, the tail dropped"
    padded = job_takes(samples, after, "pad", -1, taken)
    assert set(first) | set(padded) == set(range(samples)), "pad: every sample"
    assert len(padded) - len(set(padded)) == (-(samples - taken)) % after, "pad repeats only to even out"
    assert not set(first) & set(padded), "nothing of the prefix is taken again, padding included"
    assert rank_batches(samples, BATCH, after, "drop", taken) == batches_per_epoch(
        len(shard_order(3, 1, samples, 0, after, "drop", taken)), BATCH
    )


def test_an_offset_outside_the_epoch_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot resume at position 10"):
        shard_order(0, 0, 10, 0, 1, "pad", 10)
