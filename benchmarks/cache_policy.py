"""Which admission/eviction policy a decoded-sample cache should use when every epoch is a new shuffle.

    python -m benchmarks.cache_policy [--samples N] [--epochs E] [--out DIR]

A pure simulation, no decoding: every epoch visits all ``N`` samples once, in a new uniformly random
permutation (as training does), and a cache of a fixed byte budget answers each visit. Compared, per
budget of 25%, 50% and 75% of the dataset's bytes:

* ``keep``: admit samples in the order first seen until the next one does not fit, then never evict
  and never admit again (a static cache);
* ``lru``: admit every miss, evict the least recently used entries until it fits;
* ``fifo``: admit every miss, evict the oldest admitted entries until it fits;
* ``random``: admit every miss, evict uniformly random entries until it fits.

Two size distributions: every sample the same size, and sizes like decoded photos (width and height
uniform in [300, 1200] px, 3 bytes a pixel). Reported per policy and budget: the hit ratio (by sample
count) and the byte hit ratio (hit bytes / all bytes) of each epoch, and their means over epochs 2..E
(epoch 1 is cold, all misses, for every policy). Every policy sees the same permutations; everything
is seeded, so the output is the same on every run. The table goes to stdout, ``cache_policy.json``
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FRACTIONS = (0.25, 0.50, 0.75)
POLICIES = ("keep", "lru", "fifo", "random")
EQUAL_BYTES = 224 * 224 * 3
PHOTO_SIDE = (300, 1200)
SEED = 0


class Cache:
    """A byte budget and what it holds; ``lookup`` answers one visit and admits or evicts per policy."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.max_used = 0

    def lookup(self, key: int, size: int) -> bool:
        raise NotImplementedError

    def _account(self, delta: int) -> None:
        self.used += delta
        self.max_used = max(self.max_used, self.used)
        assert 0 <= self.used <= self.budget, (self.used, self.budget)


class Keep(Cache):
    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.held: set[int] = set()
        self.closed = False

    def lookup(self, key: int, size: int) -> bool:
        if key in self.held:
            return True
        if not self.closed:
            # The first sample that does not fit closes the cache for good, even if a smaller one would.
            if self.used + size > self.budget:
                self.closed = True
            else:
                self.held.add(key)
                self._account(size)
        return False


class Ordered(Cache):
    """LRU or FIFO: both evict from the front of one ordered dict; only LRU moves a hit to the back."""

    def __init__(self, budget: int, *, refresh_on_hit: bool) -> None:
        super().__init__(budget)
        self.held: OrderedDict[int, int] = OrderedDict()
        self.refresh_on_hit = refresh_on_hit

    def lookup(self, key: int, size: int) -> bool:
        if key in self.held:
            if self.refresh_on_hit:
                self.held.move_to_end(key)
            return True
        if size > self.budget:
            return False
        while self.used + size > self.budget:
            _, evicted = self.held.popitem(last=False)
            self._account(-evicted)
        self.held[key] = size
        self._account(size)
        return False


class RandomEvict(Cache):
    def __init__(self, budget: int, seed: int = SEED) -> None:
        super().__init__(budget)
        # A list of keys and each key's index in it: a random victim is swapped with the last key and
        # popped, O(1) where list.remove would be O(n).
        self.keys: list[int] = []
        self.position: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.rng = random.Random(seed)

    def lookup(self, key: int, size: int) -> bool:
        if key in self.position:
            return True
        if size > self.budget:
            return False
        while self.used + size > self.budget:
            self._evict(self.rng.randrange(len(self.keys)))
        self.position[key] = len(self.keys)
        self.keys.append(key)
        self.sizes[key] = size
        self._account(size)
        return False

    def _evict(self, index: int) -> None:
        victim, last = self.keys[index], self.keys[-1]
        self.keys[index] = last
        self.position[last] = index
        self.keys.pop()
        del self.position[victim]
        self._account(-self.sizes.pop(victim))


def make_cache(policy: str, budget: int, seed: int = SEED) -> Cache:
    makers: dict[str, Callable[[], Cache]] = {
        "keep": lambda: Keep(budget),
        "lru": lambda: Ordered(budget, refresh_on_hit=True),
        "fifo": lambda: Ordered(budget, refresh_on_hit=False),
        "random": lambda: RandomEvict(budget, seed),
    }
    return makers[policy]()


def equal_sizes(samples: int) -> list[int]:
    return [EQUAL_BYTES] * samples


def photo_sizes(samples: int, seed: int = SEED) -> list[int]:
    rng = np.random.default_rng(seed)
    low, high = PHOTO_SIDE
    width = rng.integers(low, high, size=samples, endpoint=True)
    height = rng.integers(low, high, size=samples, endpoint=True)
    return [int(v) for v in width * height * 3]


def permutations(samples: int, epochs: int, seed: int = SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [rng.permutation(samples).tolist() for _ in range(epochs)]


@dataclass(frozen=True)
class Result:
    sizes: str
    policy: str
    fraction: float
    budget_bytes: int
    max_bytes_held: int
    hit_ratio: list[float]
    byte_hit_ratio: list[float]

    @property
    def mean_hit_ratio(self) -> float:
        """Over epochs 2..E: the warm epochs, where the policies differ."""
        return float(np.mean(self.hit_ratio[1:]))

    @property
    def mean_byte_hit_ratio(self) -> float:
        return float(np.mean(self.byte_hit_ratio[1:]))


def simulate(
    cache: Cache, sizes: Sequence[int], orders: Sequence[Sequence[int]]
) -> tuple[list[float], list[float]]:
    """Per epoch, the hit ratio by count and by bytes."""
    total = sum(sizes)
    hits, hit_bytes = [], []
    for order in orders:
        count = volume = 0
        lookup = cache.lookup
        for key in order:
            size = sizes[key]
            if lookup(key, size):
                count += 1
                volume += size
        hits.append(count / len(order))
        hit_bytes.append(volume / total)
    return hits, hit_bytes


def run(samples: int, epochs: int, seed: int = SEED) -> list[Result]:
    distributions = {"equal": equal_sizes(samples), "photo": photo_sizes(samples, seed)}
    orders = permutations(samples, epochs, seed)
    results = []
    for label, sizes in distributions.items():
        total = sum(sizes)
        for fraction in FRACTIONS:
            budget = int(total * fraction)
            for policy in POLICIES:
                cache = make_cache(policy, budget, seed)
                hits, hit_bytes = simulate(cache, sizes, orders)
                results.append(Result(label, policy, fraction, budget, cache.max_used, hits, hit_bytes))
    return results


def format_table(results: Sequence[Result]) -> str:
    epochs = len(results[0].hit_ratio)
    per_epoch = " ".join(f"{f'e{i + 1}':>6}" for i in range(epochs))
    header = f"{'sizes':<6} {'cache':>5} {'policy':<7} | hit  {per_epoch} {'mean2+':>7} "
    header += f"| bytes {per_epoch} {'mean2+':>7}"
    lines = [header, "-" * len(header)]
    for r in results:
        hits = " ".join(f"{v:6.3f}" for v in r.hit_ratio)
        volume = " ".join(f"{v:6.3f}" for v in r.byte_hit_ratio)
        lines.append(
            f"{r.sizes:<6} {r.fraction:>5.0%} {r.policy:<7} |      {hits} {r.mean_hit_ratio:7.3f} "
            f"|       {volume} {r.mean_byte_hit_ratio:7.3f}"
        )
    return "\n".join(lines)


def to_json(results: Sequence[Result], samples: int, epochs: int, seed: int) -> str:
    rows = [
        asdict(r)
        | {"mean_hit_ratio_2plus": r.mean_hit_ratio, "mean_byte_hit_ratio_2plus": r.mean_byte_hit_ratio}
        for r in results
    ]
    return json.dumps({"samples": samples, "epochs": epochs, "seed": seed, "results": rows}, indent=1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cache_policy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--samples", type=int, default=20000, help="dataset size N")
    parser.add_argument("--epochs", type=int, default=5, help="epochs E, at least 2")
    parser.add_argument("--seed", type=int, default=SEED, help="seeds sizes, permutations, random eviction")
    parser.add_argument("--out", type=Path, help="write cache_policy.json here")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.epochs < 2:
        parser.error("--samples must be at least 1 and --epochs at least 2 (epoch 1 is always cold)")
    started = time.perf_counter()
    results = run(args.samples, args.epochs, args.seed)
    print(format_table(results))
    print(f"{args.samples} samples, {args.epochs} epochs, {time.perf_counter() - started:.1f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cache_policy.json").write_text(to_json(results, args.samples, args.epochs, args.seed))


if __name__ == "__main__":
    main()
