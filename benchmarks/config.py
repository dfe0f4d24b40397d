"""The benchmark's one typed configuration: CLI flags land here, validated once.

Two presets: the full run (sized so epoch boundaries and start-up costs do not dominate) and
``--quick`` (a small dataset and few batches, to smoke-test the whole path in a few minutes).
Explicit flags override either preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import decoder_problem, uses_roi

SCENARIOS = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l")
SCENARIO_TITLES = {
    "a": "steady-state throughput of one trainer",
    "b": "four trainers on the same data",
    "c": "time to first batch, against a warm service and against a cold one",
    "d": "overlap with a simulated accelerator step",
    "e": "consumer-side cost of next() on a ready batch",
    "f": "CPU-seconds per 1000 images, all processes",
    "g": "service memory across epochs",
    "h": "a user pipeline (torchvision v2) in the service against a DataLoader running it",
    "i": "tar shards, zip archives, a save_to_disk folder and TFRecords against the same images as files",
    "j": "a remote trainer over TCP with CURVE, and the transport alone",
    "k": "an eval feed (centre crop) against a DataLoader running the same eval transform",
    "l": "a remote trainer 50 ms away (each way, through a TCP proxy) against the same one with none",
}
CLASSES = 8
"""Class folders of the generated dataset; ``--images`` is spread over them."""


class ConfigError(ValueError):
    """A flag value the benchmark cannot run with; the message names it."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs. Defaults are the full run's."""

    data: Path | None = None
    """An ImageFolder to use instead of the generated sample dataset."""
    cache: Path = Path(".dataferry-bench/data")
    """Where generated sample datasets live (one sub-folder per size), reused when present."""
    images: int = 2560
    """Size of the generated dataset (40 batches of 64 per epoch)."""
    workers: int = 2
    """CPU processes for every contender: decode workers, DataLoader workers, decode-limit multiplier."""
    batch_size: int = 64
    image_size: int = 224
    seed: int = 0
    decoder: str = "auto"
    """The service's ``--decoder``; the decode limit runs the same per-sample work."""
    interpolations: tuple[str, ...] = INTERPOLATIONS
    """(a), (f): the resize filters timed, each by the service and by DataLoader+OpenCV. The first is
    the run's main filter: (b)-(e), (g) and (k) use it (NOTE [ One feed per filter ] in ``run``)."""
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    rounds: int = 5
    """(a), (f), (h)-(k): interleaved rounds; each round times every contender (or transport) once."""
    warmup_batches: int = 4
    """Skipped at the start of each timed segment, on top of what a contender may have buffered."""
    timed_batches: int = 30
    """(a), (f): batches timed per contender per round."""
    trainers: int = 4
    """(b): concurrent trainer processes on each side."""
    trainer_batches: int = 30
    """(b): batches each trainer times after its warm-up."""
    first_batch_repeats: int = 10
    """(c): ServiceLoader attaches timed (DataLoader constructions: half as many)."""
    overlap_epochs: int = 3
    """(d): full epochs timed per contender."""
    cost_epochs: int = 4
    """(e): epochs per batch size and contender, each giving a handful of ready-batch timings."""
    cost_batch_sizes: tuple[int, ...] = (64, 256)
    memory_epochs: int = 20
    """(g): epochs over which service memory is sampled."""
    transport_batches: int = 40
    """(j): ready batches timed per transfer (at most one epoch); also each transport trainer's credits."""
    timeout: float = 120.0
    """Seconds any single wait for a batch, a process or a result may take before the run fails."""
    json_path: Path = Path("bench-results/results.json")
    plot_path: Path | None = Path("bench-results/throughput.png")
    markdown_path: Path | None = None

    @property
    def roi(self) -> bool:
        """Whether the service (and so the decode limit) decodes train crops with the region decoder."""
        return uses_roi(self.decoder)

    @property
    def interpolation(self) -> str:
        """The run's main resize filter (``interpolations[0]``)."""
        return self.interpolations[0]

    @property
    def per_class(self) -> int:
        return math.ceil(self.images / CLASSES)

    def wants(self, *scenarios: str) -> bool:
        """True if any of ``scenarios`` was selected."""
        return any(s in self.scenarios for s in scenarios)

    def validated(self) -> BenchConfig:
        """Return self, or raise ConfigError naming the bad value."""
        _check(self.workers >= 1, "--workers must be at least 1")
        _check(self.images >= self.batch_size * 2, f"--images must be at least {self.batch_size * 2}")
        _check(bool(self.scenarios), "--scenarios selects nothing")
        unknown = sorted(set(self.scenarios) - set(SCENARIOS))
        _check(not unknown, f"unknown scenarios {','.join(unknown)} (choose from {','.join(SCENARIOS)})")
        _check(bool(self.interpolations), "--interpolations selects nothing")
        bad = sorted(set(self.interpolations) - set(INTERPOLATIONS))
        _check(not bad, f"unknown interpolations {','.join(bad)} (choose from {','.join(INTERPOLATIONS)})")
        if problem := decoder_problem(self.decoder):
            raise ConfigError(f"--{problem}")
        _check(self.data is None or self.data.is_dir(), f"--data {self.data} is not a directory")
        counts = (
            "rounds",
            "timed_batches",
            "trainers",
            "trainer_batches",
            "memory_epochs",
            "transport_batches",
        )
        for name in counts:
            _check(getattr(self, name) >= 1, f"{name} must be at least 1")
        return self


QUICK = {
    "images": 1024,
    "rounds": 3,
    "warmup_batches": 2,
    "timed_batches": 6,
    "trainer_batches": 6,
    "first_batch_repeats": 6,
    "overlap_epochs": 2,
    "cost_epochs": 3,
    "memory_epochs": 4,
    "transport_batches": 16,
    "timeout": 60.0,
}
"""What ``--quick`` changes: 1024 images is 16 batches of 64 and 4 of 256 per epoch."""


def parse_scenarios(text: str) -> tuple[str, ...]:
    """``"a,c, e"`` -> ``("a", "c", "e")`` in canonical order; unknown letters are kept for validation."""
    picked = {part.strip().lower() for part in text.split(",") if part.strip()}
    known = tuple(s for s in SCENARIOS if s in picked)
    return known + tuple(sorted(picked - set(SCENARIOS)))


def parse_interpolations(text: str) -> tuple[str, ...]:
    """``"area, bilinear,area"`` -> ``("area", "bilinear")``: the order given (the first is the main
    filter), duplicates dropped; unknown names are kept for validation."""
    picked = [part.strip().lower() for part in text.split(",") if part.strip()]
    return tuple(dict.fromkeys(picked))


def make_config(quick: bool, **overrides: object) -> BenchConfig:
    """The preset for ``quick``, then every override that is not None, validated."""
    base = replace(BenchConfig(), **QUICK, quick=True) if quick else BenchConfig()  # type: ignore[arg-type]
    chosen = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **chosen).validated()  # type: ignore[arg-type]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
