"""A mixture's order (NOTE [ Mixture order ], NOTE [ Weightings ]): shares exact in every prefix
of an epoch, every sample of a source once per pass, weight changes that keep the past, and epochs
shared out among ranks, resumed at another world size, as a single source's are."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from loader_service.dataset import marks as marks_module
from loader_service.dataset.marks import EpochMarks, Rule, State, epoch_draws, walk
from loader_service.dataset.mixture import Mixture, Weighting, integer_weights
from loader_service.dataset.sampler import ShardOrder
from loader_service.dataset.tables import DatasetError
from protocol.shares import shard_size
from protocol.weights import MAX_EPOCH_SAMPLES, WEIGHT_UNIT

weights_st = st.lists(st.integers(0, 1000), min_size=1, max_size=10).filter(any)


def prefix_counts(source: np.ndarray, sources: int) -> np.ndarray:
    """``counts[j, s]``: positions of source ``s`` among the first ``j`` (j from 0 to len)."""
    one_hot = np.zeros((len(source) + 1, sources), np.int64)
    one_hot[np.arange(1, len(source) + 1), source] = 1
    return np.cumsum(one_hot, axis=0)


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, samples=st.integers(1, 2500))
def test_every_prefix_of_an_epoch_is_within_tijdemans_bound_of_each_share(
    weights: list[int], samples: int
) -> None:
    """``|count - share| <= 1 - 1 / (2k - 2)`` for ``k`` sources, in every prefix, exactly."""
    draws = epoch_draws(samples, ((0, tuple(weights)),))
    counts = prefix_counts(draws.source, len(weights))
    total, k = sum(weights), len(weights)
    targets = np.outer(np.arange(samples + 1), np.asarray(weights, np.int64))
    off = np.abs(counts * total - targets).max()  # in units of 1 / total
    if k == 1:
        assert off == 0
    else:
        assert off * (2 * k - 2) <= (2 * k - 3) * total
    assert draws.counts == tuple(int(c) for c in counts[-1])


def test_the_largest_deficit_alone_would_stray_past_one_sample() -> None:
    """The case NOTE [ Mixture order ] names, where the plain deficit rule is 870/869 off: within
    1 - 1/6 here."""
    weights = (6, 95, 384, 384)
    counts = prefix_counts(epoch_draws(43, ((0, weights),)).source, 4)
    targets = np.outer(np.arange(44), np.asarray(weights))
    assert np.abs(counts * sum(weights) - targets).max() * 6 <= 5 * sum(weights)


def test_the_rule_by_hand() -> None:
    """Weights 1:1:2 over 8 positions; on a tie the earlier source goes first."""
    assert epoch_draws(8, ((0, (1, 1, 2)),)).source.tolist() == [2, 0, 1, 2, 2, 0, 1, 2]


@settings(max_examples=100, deadline=None)
@given(
    old=weights_st,
    new_seed=st.integers(0, 2**32 - 1),
    samples=st.integers(2, 1500),
    cut=st.floats(0.0, 1.0),
)
def test_a_weight_change_keeps_the_past_and_follows_the_new_weights_after(
    old: list[int], new_seed: int, samples: int, cut: float
) -> None:
    """Within 1.5 samples of the targets the old and then the new weights accumulate: the deficits
    left at the change carry over (0.96 is the most seen, NOTE [ Weightings ])."""
    new = [int(x) for x in np.random.default_rng(new_seed).integers(0, 1000, len(old))]
    if not any(new):
        new[0] = 1
    at = int(cut * (samples - 1))
    plain = epoch_draws(samples, ((0, tuple(old)),))
    changed = epoch_draws(samples, ((0, tuple(old)), (at, tuple(new))))
    assert np.array_equal(changed.source[:at], plain.source[:at]), (
        "the positions before it keep their sources"
    )
    counts = prefix_counts(changed.source, len(old))
    d_old, d_new = sum(old), sum(new)
    j = np.arange(samples + 1)[:, None]
    scaled_targets = (
        np.minimum(j, at) * np.asarray(old) * d_new + np.maximum(j - at, 0) * np.asarray(new) * d_old
    )
    assert np.abs(2 * counts * d_old * d_new - 2 * scaled_targets).max() < 3 * d_old * d_new


def draws_by_source(mixture: Mixture, epochs: int) -> list[list[int]]:
    """Each source's samples in the order the run draws them, over ``epochs`` epochs."""
    offsets = mixture.offsets.tolist()
    found: list[list[int]] = [[] for _ in mixture.sizes]
    every = np.arange(mixture.epoch_samples, dtype=np.int64)
    for e in range(epochs):
        epoch = mixture.epoch(e)
        for source, sample in zip(epoch.sources(every).tolist(), epoch.at(every).tolist(), strict=True):
            found[source].append(sample - offsets[source])
    return found


def test_every_sample_of_a_source_once_per_pass_however_often_it_wraps() -> None:
    """A source of 5 beside ones of 13 and 40, weighted 3:3:1 over epochs of 50: the small one runs
    out about six times an epoch and the large one takes several epochs for a pass."""
    sizes = (5, 13, 40)
    mixture = Mixture.of(sizes, seed=7, epoch_samples=50, weights=(3, 3, 1))
    found = draws_by_source(mixture, 12)
    for size, drawn in zip(sizes, found, strict=True):
        passes = len(drawn) // size
        assert passes >= 1
        for p in range(passes):
            assert sorted(drawn[p * size : (p + 1) * size]) == list(range(size)), f"pass {p} of {size}"
    assert found[0][:5] != found[0][5:10], "each pass its own order"


def test_without_weights_each_source_once_an_epoch() -> None:
    sizes = (7, 3, 12)
    mixture = Mixture.of(sizes, seed=1)
    assert mixture.epoch_samples == 22
    every = np.arange(22, dtype=np.int64)
    orders = [mixture.epoch(e).at(every) for e in range(4)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(22))
    assert len({tuple(o.tolist()) for o in orders}) == 4, "each epoch its own order"
    assert Mixture.of(sizes, seed=2).epoch(0).at(every).tolist() != orders[0].tolist()


def test_positions_give_the_same_samples_however_they_are_asked_for() -> None:
    mixture = Mixture.of(
        (30, 11, 57), seed=3, epoch_samples=64, weights=integer_weights({"a": 0.5, "b": 0.3, "c": 0.2}, "abc")
    )
    epoch = mixture.epoch(5)
    whole = epoch.at(np.arange(64, dtype=np.int64))
    picked = np.array([63, 0, 17, 17, 42, 5], np.int64)
    assert np.array_equal(epoch.at(picked), whole[picked])
    assert np.array_equal(
        Mixture.of((30, 11, 57), seed=3, epoch_samples=64, weights=mixture.weighting.changes[0][1])
        .epoch(5)
        .at(picked),
        whole[picked],
    )


def test_where_the_sources_stand_at_an_epoch_is_the_sum_of_the_epochs_before_it() -> None:
    """``before`` sums runs of alike epochs; replaying every epoch gives the same, changes included."""
    base = Mixture.of((9, 4, 20), seed=5, epoch_samples=10, weights=(5, 3, 2))
    weighting = base.weighting.then(23, (1, 1, 8)).then(24, (2, 0, 1)).then(71, (0, 1, 0))
    mixture = Mixture(base.sizes, base.seed, base.epoch_samples, weighting)
    replayed = np.zeros(3, np.int64)
    for e in range(12):
        assert mixture.before(e) == tuple(replayed.tolist()), f"epoch {e}"
        replayed += mixture.epoch(e).counts
    assert mixture.epoch(7).counts == (1, 9, 0), "position 70 still had the weights of position 24"
    assert mixture.epoch(8).counts == (0, 10, 0), "from 71 on only source 1 has a weight"


def shares(epoch: object, world: int, remainder: str, offset: int = 0) -> list[list[int]]:
    """Each rank's samples of ``epoch`` from ``offset`` on, as ``ShardOrder`` shares them out."""
    samples = epoch.samples  # type: ignore[attr-defined]
    size = shard_size(samples - offset, world, remainder)
    return [ShardOrder(epoch, r, world, size, offset).indices(0, size).tolist() for r in range(world)]  # type: ignore[arg-type]


def test_ranks_share_a_mixture_epoch_and_resume_it_at_another_world_size() -> None:
    mixture = Mixture.of((40, 25, 35), seed=11, epoch_samples=90, weights=(2, 1, 1))
    epoch = mixture.epoch(2)
    whole = epoch.at(np.arange(90, dtype=np.int64)).tolist()
    by_two = shares(epoch, 2, "drop")
    assert sorted(by_two[0] + by_two[1]) == sorted(whole)
    # Two ranks take 3 batches of 6 each (36 positions); three ranks go on from there.
    taken = [s for r in range(2) for s in by_two[r][:18]]
    rest = shares(epoch, 3, "drop", offset=36)
    assert sorted(taken + [s for r in rest for s in r]) == sorted(whole), "nothing lost, nothing twice"


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1.0, "b": 1.0, "x": 1.0}, r"each source of the feed \(a, b, c\) once.*unknown x"),
        ({"a": 1.0}, "missing b, c"),
        ({"a": -1.0, "b": 1.0, "c": 1.0}, "weight of 'a' must be a finite number >= 0"),
        ({"a": math.nan, "b": 1.0, "c": 1.0}, "weight of 'a' must be a finite number"),
        ({"a": math.inf, "b": 1.0, "c": 1.0}, "weight of 'a' must be a finite number"),
        ({"a": True, "b": 1.0, "c": 1.0}, "weight of 'a' must be a finite number"),
        ({"a": 0.0, "b": 0, "c": 0.0}, "weights are all zero"),
    ],
)
def test_bad_weights_are_refused_by_name(weights: dict[str, float], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        integer_weights(weights, ("a", "b", "c"))


def test_weights_are_shares_whatever_their_scale() -> None:
    assert integer_weights({"a": 6, "b": 4}, "ab") == integer_weights({"a": 0.6, "b": 0.4}, "ab")
    tiny = integer_weights({"a": 1e-30, "b": 0.0}, "ab")
    assert tiny[0] > 0 and tiny[1] == 0


def test_a_change_is_never_in_the_past_of_another() -> None:
    weighting = Weighting.constant((1, 1)).then(100, (1, 2))
    with pytest.raises(ValueError, match="before the last one"):
        weighting.then(99, (2, 1))
    assert weighting.then(100, (3, 1)).changes == ((0, (1, 1)), (100, (3, 1))), "the same position: replaced"


@pytest.mark.parametrize(
    ("sizes", "epoch_samples", "weights", "message"),
    [
        ((5, 0), 0, (), "every source of a mixture needs a sample"),
        ((5, 3), 10, (), "epoch_samples needs weights"),
        ((5, 3), 0, (1, 1), "a mixture's epoch holds 1 to"),
        ((5, 3), MAX_EPOCH_SAMPLES + 1, (1, 1), "choose a smaller epoch_samples"),
    ],
)
def test_a_mixture_that_cannot_be_is_refused(
    sizes: tuple[int, ...], epoch_samples: int, weights: tuple[int, ...], message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        Mixture.of(sizes, 0, epoch_samples, weights)


def segments_of(weighting: list[tuple[int, list[int]]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A weighting of ``k`` weights from its first entry's length on, none all zero."""
    k = len(weighting[0][1])
    changes = {p: [*(w * k)[: k - 1], 1] for p, w in weighting[1:]}
    return tuple((p, tuple(w)) for p, w in sorted({**changes, 0: weighting[0][1]}.items()))


def walked_in_python(rule: Rule, state: State, stop: int, *args: object) -> State:
    try:
        built, marks_module._mixture = marks_module._mixture, None
        rule = Rule(rule.bounds, rule.scaled, rule.total)  # not yet told it is walked in C
        return walk(rule, state, stop, *args)  # type: ignore[arg-type]
    finally:
        marks_module._mixture = built


weightings = st.lists(
    st.tuples(st.integers(0, 3000), weights_st.filter(lambda w: len(w) > 1)), min_size=1, max_size=4
)


@settings(max_examples=150, deadline=None)
@given(weighting=weightings, samples=st.integers(1, 3000), cut=st.floats(0.0, 1.0))
def test_the_c_walk_is_the_python_one(
    weighting: list[tuple[int, list[int]]], samples: int, cut: float
) -> None:
    """``_mixture.c`` and the reference in Python give the same sources, draws and marks, changes
    included (their weights' sums differ: the walk takes their lcm), and the same state where a
    walk is cut in two."""
    if marks_module._mixture is None:
        pytest.skip("_mixture.c is not built here (no C compiler at install)")
    rule = Rule.of(samples, segments_of(weighting))
    assume(rule.in_c)  # sums past 2^44 are walked in Python either way
    zero = np.zeros(rule.sources, np.int64)
    results = []
    for walker in (walk, walked_in_python):
        outputs = np.zeros(samples, np.uint16), np.zeros(samples, np.int32)
        marks = np.zeros((-(-samples // rule.stride), rule.sources), np.int8)
        middle = walker(rule, State(0, zero, zero), int(cut * samples))
        rest = (outputs[0][middle.position :], outputs[1][middle.position :])
        end = walker(rule, middle, samples, rest, marks)
        results.append((outputs[0].tolist(), outputs[1].tolist(), marks.tolist(), end.drawn.tolist()))
    assert results[0] == results[1]


@settings(max_examples=100, deadline=None)
@given(weighting=weightings, samples=st.integers(1, 3000), picked=st.lists(st.floats(0.0, 1.0), max_size=40))
def test_marks_give_every_position_the_whole_walk_gives(
    weighting: list[tuple[int, list[int]]], samples: int, picked: list[float]
) -> None:
    """NOTE [ Epoch marks ]: positions asked for in any order, windows resumed from marks or from
    where the last one ended, and the draws before any position, are the whole walk's."""
    segments = segments_of(weighting)
    whole = epoch_draws(samples, segments)
    marks = EpochMarks.choose(Rule.of(samples, segments), lambda: True)
    assert marks is not None and marks.counts == whole.counts
    positions = np.asarray([int(f * (samples - 1)) for f in picked], np.int64)
    source, draw = marks.lookup(positions)
    assert source.tolist() == whole.source[positions].tolist()
    assert draw.tolist() == whole.draw[positions].tolist()
    for p in positions.tolist():
        counts = np.bincount(whole.source[:p], minlength=len(weighting[0][1]))
        assert marks.drawn_at(p).tolist() == counts.tolist()
    assert marks.window(0, samples)[0].tolist() == whole.source.tolist()


def test_the_largest_epoch_is_held_in_little_memory() -> None:
    """NOTE [ Epoch marks ]: the largest epoch of three sources holds 12 KiB, not 96 MiB, and a
    batch's positions cost a walk of at most a stride from their mark."""
    weights = integer_weights({"a": 0.5, "b": 0.3, "c": 0.2}, "abc")
    epoch = Mixture.of((7, 11, 13), 1, MAX_EPOCH_SAMPLES, weights).epoch(0)
    assert epoch.marks.marks.nbytes == 12 * 1024
    assert sum(epoch.counts) == MAX_EPOCH_SAMPLES
    near_the_end = np.arange(MAX_EPOCH_SAMPLES - 64, MAX_EPOCH_SAMPLES, dtype=np.int64)
    assert epoch.sources(near_the_end).tolist() == epoch.sources(near_the_end[::-1]).tolist()[::-1]
    assert epoch.drawn_before(MAX_EPOCH_SAMPLES).tolist() == list(epoch.counts)


def test_weights_sum_to_the_unit_exactly() -> None:
    """Largest remainders: whatever the floats, one sum (the C choice's deficits share it)."""
    for weights in ({"a": 1, "b": 1, "c": 1}, {"a": 0.1, "b": 0.7, "c": 1e-9}, {"a": 3, "b": 0, "c": 5}):
        assert sum(integer_weights(weights, "abc")) == WEIGHT_UNIT
    assert integer_weights({"a": 1, "b": 1, "c": 1}, "abc") == (1431655766, 1431655765, 1431655765)
