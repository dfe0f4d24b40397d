"""Which source, and which of its samples, each position of a mixture's epoch draws (issue 38).

A mixture is several sources read as one feed, with weights that belong to the job reading it. Its
order is a pure function of (seed, the sources' sizes, the epoch's length, the weighting), so
every rank, every restart and every service computes the same sequence.

NOTE [ Mixture order ]
    An epoch of a mixture is ``epoch_samples`` positions. Weights are held as integers ``W_s``
    (``integer_weights``), so that every step is exact integer arithmetic and no platform rounds
    differently. Source ``s``'s deficit after position ``j`` is its share of the first ``j + 1``
    positions, ``W_s * (j + 1) / sum(W)``, less the positions it already has. Position ``j`` goes,
    among the sources whose deficit is at least ``1 / (2k - 2)`` (``k`` sources; some always is),
    to the one whose deficit would reach ``1 - 1 / (2k - 2)`` first at its weight: the earliest
    deadline (the earlier source on a tie). This is Tijdeman's solution of the chairman assignment
    problem: in every prefix of an epoch each source's count is within ``1 - 1 / (2k - 2)`` of its
    share (0.75 with three sources), and tests/unit/test_mixture.py checks that bound exactly on
    every prefix of random cases. The plain deficit rule (the source with the largest deficit
    next, as Megatron-LM's blended datasets do) strays past one sample: 870/869 of a sample with
    weights 6:95:384:384 at position 43, 1.05 with nine sources.

    Each epoch starts from zero deficits: an epoch's counts are then a function of its own weights
    alone, the same for every epoch with the same weights, and where the sources stand at any
    epoch's start is a sum, not a replay of the epochs before it. Over many epochs a source's total
    can thus drift from its share by less than one sample an epoch (one in ``epoch_samples``).
    Choosing costs O(epoch_samples x sources) once for each distinct epoch (its length and the
    weights in it: every epoch, every job with the same ones share it), and holds the epoch's
    order as marks, a byte a source every few thousand positions, each batch's positions walked
    again from the nearest (NOTE [ Epoch marks ]). The service chooses on a thread, not in its
    main loop (NOTE [ Choosing off the main loop ]), and in C (``_mixture.c``, the same integers,
    the GIL released; a test holds it to the Python reference): 10 ms for a million positions of
    three sources here, 0.3 s for the largest epoch (50 times the Python's 0.53 s a million, which
    remains where the extension is not built). A batch's samples then cost its window's walk and
    one keyed permutation per (source, pass) among its rows (96 us for 64 rows of three sources).

    Inside a source, its ``m``-th draw since the run began is position ``m % size`` of pass
    ``m // size`` over it, a keyed permutation of that pass (``EpochOrder``, keyed by the source's
    position and the pass): every sample of a source exactly once per pass; a source that runs out
    starts its next pass at once, never truncated, never repeated inside a pass.

    Without weights, ``W_s`` is the source's size and the epoch is the sum of the sizes: every
    source exactly once per epoch, interleaved in proportion.

NOTE [ Weightings ]
    A job may change its weights from a global position on (``epoch * epoch_samples + j``: a
    position, not a step, so a resume at another world size finds it where it was). Inside an
    epoch the deficit rule's targets then grow by the old weights up to that position and by the
    new ones after it, and the deficits left at the change carry over (all weights scaled to one
    common sum), so the positions before the change keep exactly the sources they had, and every
    prefix after it stays near the accumulated targets: within 1.5 samples (tested; 0.96 the most
    seen in 6,000 random weightings of up to eight sources, where Tijdeman's bound is not proven).
    Changes are never in the past: ``Weighting.then`` refuses a position before the last change.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from loader_service.dataset.marks import SHELF, EpochMarks, Going, Rule, always
from loader_service.dataset.sampler import epoch_order
from loader_service.dataset.tables import DatasetError, offsets_of
from protocol.weights import MAX_EPOCH_SAMPLES, WEIGHT_UNIT, WeightError, whole_weights

MAX_WEIGHTING_CHOICE = 1 << 26
"""Positions a start may have to choose for a job's weight changes (each epoch that holds one, and
the one after it): about 1.3 s of the chooser thread in C at this bound, once per weighting (each
epoch's counts are kept, ``KEPT_COUNTS``), during which that job waits."""
_SOURCE_TAG = 0x50C


def integer_weights(weights: Mapping[str, float], names: Sequence[str]) -> tuple[int, ...]:
    """``weights`` by source name as whole numbers summing to ``WEIGHT_UNIT``, in the order of
    ``names``: the rule both sides keep (``protocol.weights``), refusing with a DatasetError."""
    try:
        return whole_weights(weights, names)
    except WeightError as exc:
        raise DatasetError(str(exc)) from None


@dataclass(frozen=True)
class Weighting:
    """Weights from global positions on (NOTE [ Weightings ]): ``(position, weights)``, the
    first at position 0, positions increasing."""

    changes: tuple[tuple[int, tuple[int, ...]], ...]
    first: tuple[int, ...] = ()
    """The weights it began with, before any change (one at position 0 included)."""

    def __post_init__(self) -> None:
        if not self.first:
            object.__setattr__(self, "first", self.changes[0][1])

    @classmethod
    def constant(cls, weights: tuple[int, ...]) -> Weighting:
        return cls(((0, weights),))

    def then(self, position: int, weights: tuple[int, ...]) -> Weighting:
        """This weighting with ``weights`` from ``position`` on; ValueError for a position before
        the last change (a change is never in the past of another)."""
        last = self.changes[-1][0]
        if position < last:
            raise ValueError(f"a weight change at position {position} is before the last one, at {last}")
        if len(weights) != len(self.changes[-1][1]):
            raise ValueError(f"{len(weights)} weights for {len(self.changes[-1][1])} sources")
        kept = tuple(c for c in self.changes if c[0] < position)
        return Weighting((*kept, (position, weights)), self.first)

    def within(self, start: int, stop: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The weights in force over positions ``[start, stop)``, as changes relative to ``start``."""
        inside = [(max(p - start, 0), w) for p, w in self.changes if p < stop]
        first = max(i for i, (p, _) in enumerate(inside) if p == 0)
        return tuple(inside[first:])


@dataclass(frozen=True)
class Mixture:
    """The sources of a feed and a job's weights over them: the whole run's order."""

    sizes: tuple[int, ...]
    seed: int
    epoch_samples: int
    weighting: Weighting

    @property
    def weights(self) -> tuple[int, ...]:
        """The weights the job began with (its hello's); the fingerprint of its states covers them."""
        return self.weighting.first

    def changed(self, changes: Sequence[tuple[int, Sequence[float]]], names: Sequence[str]) -> Mixture:
        """The job's first weights, then ``changes`` (a start's: weights of ``names`` in order, NOTE
        [ Weightings ]); DatasetError for weights ``integer_weights`` refuses, a change
        before another, or a weighting that would cost a start too much choosing."""
        weighting = Weighting.constant(self.weights)
        for position, given in changes:
            if len(given) != len(names):
                raise DatasetError(f"a weight change gives {len(given)} weights for {len(names)} sources")
            by_name = dict(zip(names, given, strict=True))
            try:
                weighting = weighting.then(position, integer_weights(by_name, names))
            except ValueError as exc:
                raise DatasetError(str(exc)) from None
        n = self.epoch_samples
        chosen = 2 * len({p // n for p, _ in weighting.changes}) * n
        if chosen > MAX_WEIGHTING_CHOICE:
            raise DatasetError(
                f"{len(changes)} weight changes over epochs of {n} samples: the service chooses at "
                f"most {MAX_WEIGHTING_CHOICE} positions for a job's weighting (choose a smaller "
                "epoch_samples, or fewer changes)"
            )
        return dataclasses.replace(self, weighting=weighting)

    @classmethod
    def of(
        cls, sizes: Sequence[int], seed: int, epoch_samples: int = 0, weights: tuple[int, ...] = ()
    ) -> Mixture:
        """Without ``weights``, each source once per epoch (``epoch_samples`` must then be 0 or their
        sum); DatasetError for an empty source or an epoch of no samples."""
        if not sizes or min(sizes) < 1:
            raise DatasetError(f"every source of a mixture needs a sample: sizes {list(sizes)}")
        if not weights:
            if epoch_samples not in (0, sum(sizes)):
                raise DatasetError("epoch_samples needs weights: without them an epoch is every source once")
            weights, epoch_samples = tuple(sizes), sum(sizes)
        if not 1 <= epoch_samples <= MAX_EPOCH_SAMPLES:
            raise DatasetError(
                f"a mixture's epoch holds 1 to {MAX_EPOCH_SAMPLES} samples, not {epoch_samples} "
                "(choose a smaller epoch_samples: the run goes on across epochs)"
            )
        return cls(tuple(sizes), seed, epoch_samples, Weighting.constant(weights))

    @cached_property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Where each source's samples begin in the feed's numbering (the sources one after
        another), the feed's size last; made once, read at every batch."""
        return offsets_of(self.sizes)

    @cached_property
    def size_array(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.sizes, np.int64)

    @cached_property
    def source_seeds(self) -> tuple[int, ...]:
        """Each source's key of its passes (``source_seed``), made once: a batch asks for it."""
        return tuple(source_seed(self.seed, s) for s in range(len(self.sizes)))

    def epoch(self, epoch: int) -> MixtureEpoch:
        """Epoch ``epoch``'s order, walked here where it is not known (the service's chooser thread
        asks for it with ``choose``, NOTE [ Choosing off the main loop ])."""
        chosen = self.choose(epoch)
        assert chosen is not None
        return chosen

    def choose(self, epoch: int, going: Going = always) -> MixtureEpoch | None:
        """``epoch``'s order; None if ``going`` turned false before it was walked."""
        marks = SHELF.marks(self._rule(epoch), going)
        start = self._before(epoch, lambda rule: SHELF.counts(rule, going))
        return None if marks is None or start is None else MixtureEpoch(self, epoch, marks, start)

    def known(self, epoch: int) -> MixtureEpoch | None:
        """``epoch``'s order if nothing is left to walk for it (an order alive shares its marks)."""
        marks = SHELF.known(self._rule(epoch))
        start = self._before(epoch, SHELF.known_counts)
        return None if marks is None or start is None else MixtureEpoch(self, epoch, marks, start)

    def before(self, epoch: int) -> tuple[int, ...]:
        """Each source's draws in the epochs before ``epoch``: O(changes), not a replay. Between two
        epochs that hold a change, the epochs hold none and draw alike."""
        found = self._before(epoch, lambda rule: SHELF.counts(rule, always))
        assert found is not None
        return found

    def _before(
        self, epoch: int, counts_of: Callable[[Rule], tuple[int, ...] | None]
    ) -> tuple[int, ...] | None:
        n = self.epoch_samples
        marks = sorted({min(p // n, epoch) for p, _ in self.weighting.changes} | {epoch})
        totals = np.zeros(len(self.sizes), np.int64)
        for first, stop in itertools.pairwise(marks):
            for alike, times in ((first, 1), (first + 1, stop - first - 1)):
                if times < 1:
                    continue
                counts = counts_of(self._rule(alike))
                if counts is None:
                    return None
                totals += np.asarray(counts, np.int64) * times
        return tuple(int(t) for t in totals)

    def _rule(self, epoch: int) -> Rule:
        n = self.epoch_samples
        return Rule.of(n, self.weighting.within(epoch * n, (epoch + 1) * n))


def describe(mixture: Mixture | None, names: Sequence[str]) -> str:
    """A job's order in words, for a refusal: its first weights' shares and its epoch's length."""
    if mixture is None:
        return "the feed's own order (no weights)"
    shares = ", ".join(
        f"{name} {w / WEIGHT_UNIT:.3g}" for name, w in zip(names, mixture.weights, strict=True)
    )
    return f"weights {shares} in epochs of {mixture.epoch_samples}"


@dataclass(frozen=True, eq=False)
class MixtureEpoch:
    """One epoch of a mixture as an order: ``at(positions)`` gives the feed's sample numbers (a
    source's offset plus its sample), so a ``ShardOrder`` shares it out among ranks as it shares an
    ``EpochOrder`` (the same remainder rules, the same resume by position)."""

    mixture: Mixture
    number: int
    marks: EpochMarks
    """The epoch's sources, held as NOTE [ Epoch marks ]."""
    start: tuple[int, ...]
    """Each source's draws before this epoch."""

    @property
    def samples(self) -> int:
        return self.mixture.epoch_samples

    @property
    def counts(self) -> tuple[int, ...]:
        """Each source's positions in the epoch."""
        return self.marks.counts

    def sources(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The source of each position."""
        return self.marks.lookup(np.asarray(positions, np.int64))[0]

    def drawn_before(self, position: int) -> npt.NDArray[np.int64]:
        """Each source's draws in the run before ``position`` of this epoch (NOTE [ Source ledger ])."""
        return self._start + self.marks.drawn_at(position)

    def at(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The feed's sample number at each position (each in ``[0, samples)``)."""
        mixture = self.mixture
        source, draw = self.marks.lookup(np.asarray(positions, np.int64))
        drawn = self._start[source] + draw
        passes, inside = np.divmod(drawn, mixture.size_array[source])
        local = np.empty(source.shape, np.int64)
        # Rows of one (source, pass) share one keyed order: a batch holds a few such groups.
        groups = source * (int(passes.max(initial=0)) + 1) + passes
        for group in np.unique(groups).tolist():
            mask = groups == group
            s, p = int(source[mask][0]), int(passes[mask][0])
            order = epoch_order(mixture.source_seeds[s], p, mixture.sizes[s])
            local[mask] = order.at(inside[mask])
        result: npt.NDArray[np.int64] = mixture.offsets[source] + local
        return result

    @cached_property
    def _start(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.start, np.int64)


def source_seed(seed: int, source: int) -> int:
    """The key of source ``source``'s passes: its own, so that two sources of one size differ."""
    mixed = np.random.SeedSequence([seed, source, _SOURCE_TAG]).generate_state(1, np.uint64)[0]
    return int(mixed)
