"""The PNG: throughput over time in (a), data stall over time in (d), service memory over (g)'s epochs.

matplotlib is imported only here and only when a plot is asked for (it costs a second at start-up),
with the Agg backend, because the benchmark runs on machines without a display.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.results import CONTENDERS, DECODE_LIMIT, BenchResults, Measurement, Timeline
from benchmarks.stats import rolling

if TYPE_CHECKING:
    from matplotlib.axes import Axes

WINDOW = 5
"""Batches per rolling point: smooths per-batch jitter without hiding a stall."""


def _series(timelines: Mapping[str, Timeline], prefix: str) -> dict[str, Timeline]:
    return {
        name.removeprefix(prefix): t for name, t in timelines.items() if name.startswith(prefix) and t.ends
    }


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not run", ha="center", va="center", transform=ax.transAxes)


def _throughput(ax: Axes, results: BenchResults) -> None:
    series = _series(results.timelines, "a:")
    ax.set_title(f"(a) throughput while timed, rolling {WINDOW} batches")
    ax.set_xlabel("timed seconds (segments of all rounds joined)")
    ax.set_ylabel("images/s")
    if not series:
        _empty(ax, "(a)")
        return
    for key, t in series.items():
        if key != DECODE_LIMIT:
            points = rolling(t.ends, t.images, t.waits, WINDOW)
            ax.plot(
                [p.t for p in points], [p.images_per_second for p in points], label=CONTENDERS.get(key, key)
            )
    a = results.get("a")
    limit = a.median(DECODE_LIMIT) if a else None
    if limit is not None:
        ax.axhline(limit, linestyle="--", color="grey", label="decode limit (median)")
    ax.legend(loc="lower right")


def _stall(ax: Axes, results: BenchResults) -> None:
    series = _series(results.timelines, "d:")
    ax.set_title(f"(d) data stall with a simulated step, rolling {WINDOW} batches")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of time waiting")
    if not series:
        _empty(ax, "(d)")
        return
    for key, t in series.items():
        points = rolling(t.ends, t.images, t.waits, WINDOW)
        ax.plot([p.t for p in points], [p.stall for p in points], label=CONTENDERS.get(key, key))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")


def _memory(ax: Axes, g: Measurement | None) -> None:
    ax.set_title("(g) service memory after each epoch")
    ax.set_xlabel("epoch")
    ax.set_ylabel("MiB")
    if g is None:
        _empty(ax, "(g)")
        return
    for key, label in (
        ("rss_mib", "RSS, process tree"),
        ("rss_anon_mib", "anonymous"),
        ("shm_mib", "/dev/shm"),
    ):
        series = g.samples.get(key, ())
        ax.plot(range(1, len(series) + 1), series, marker="o", label=label)
    ax.legend(loc="center right")


def write_plot(results: BenchResults, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 11))
    _throughput(axes[0], results)
    _stall(axes[1], results)
    _memory(axes[2], results.get("g"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
