from __future__ import annotations

import numpy as np
import pytest

from loader_service.dataset.sampler import (
    batch_of,
    batches_per_epoch,
    epoch_permutation,
    sample_rng,
    shard_plan,
    shard_size,
)


def test_permutation_is_a_pure_function_of_seed_and_epoch() -> None:
    a = epoch_permutation(1, 0, 1000)
    epoch_permutation.cache_clear()
    assert np.array_equal(a, epoch_permutation(1, 0, 1000))
    assert not np.array_equal(a, epoch_permutation(1, 1, 1000))
    assert not np.array_equal(a, epoch_permutation(2, 0, 1000))
    assert sorted(a.tolist()) == list(range(1000))


def test_batches_cover_the_epoch_once_with_a_short_last_batch() -> None:
    n, b = 103, 10
    assert batches_per_epoch(n, b) == 11
    plan = epoch_permutation(5, 3, n)
    parts = [batch_of(plan, s, b) for s in range(11)]
    assert [len(p) for p in parts] == [10] * 10 + [3]
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    with pytest.raises(ValueError):
        batch_of(plan, 11, b)


def test_sample_randomness_depends_on_sample_not_order() -> None:
    assert sample_rng(0, 1, 42).random() == sample_rng(0, 1, 42).random()
    assert sample_rng(0, 1, 42).random() != sample_rng(0, 2, 42).random()
    assert sample_rng(0, 1, 42).random() != sample_rng(0, 1, 43).random()


@pytest.mark.parametrize(("samples", "world"), [(10, 4), (12, 4), (7, 3), (3, 8), (1000, 7)])
def test_shard_plans_are_disjoint_equal_and_cover_the_epoch(samples: int, world: int) -> None:
    perm = epoch_permutation(9, 2, samples)
    for remainder in ("pad", "drop"):
        plans = [shard_plan(9, 2, samples, r, world, remainder) for r in range(world)]
        assert len({len(p) for p in plans}) == 1, "equal steps on every rank"
        assert len(plans[0]) == shard_size(samples, world, remainder)
        together = np.concatenate(plans)
        if remainder == "drop":
            assert len(set(together.tolist())) == len(together) == samples - samples % world
        else:
            assert set(together.tolist()) == set(range(samples))
            assert len(together) - samples == (-samples) % world
    # rank r takes every world-th element of the permutation, as DistributedSampler does
    assert (
        shard_plan(9, 2, samples, 0, world, "drop").tolist()
        == perm[: samples - samples % world : world].tolist()
    )
