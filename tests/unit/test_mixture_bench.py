"""``python -m benchmarks.mixture --quick``: three sources mixed by weight against one source and
against Hugging Face's interleave_datasets, in one short run; the realized shares are the weights
asked (weights unlike the sources' sizes, so a feed that ignored them would fail); and the module's
pure parts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.mixture import NAMES, TITLES, format_table, ratio_summary, split_counts, summarize
from tests.helpers import REPO

WEIGHTS = (0.2, 0.3, 0.5)
"""The reverse of the sources' sizes (50/30/20 %): the feed's own order would give 0.5/0.3/0.2."""


def test_split_counts_sum_to_the_total_in_the_shares() -> None:
    assert split_counts(48, (0.5, 0.3, 0.2)) == [24, 14, 10]
    assert split_counts(10, (0.5, 0.3, 0.2)) == [5, 3, 2]
    assert split_counts(7, (1, 1, 1)) == [3, 2, 2]
    assert sum(split_counts(321, (0.5, 0.3, 0.2))) == 321


def test_ratio_summary_is_the_median_per_round_ratio_with_its_spread() -> None:
    got = ratio_summary([110.0, 100.0, 90.0], [100.0, 100.0, 100.0], 0.95)
    assert got["median"] == 1.0 and got["per_round"] == [1.1, 1.0, 0.9] and got["met"]
    assert math.isclose(got["spread"], 0.1)
    assert not ratio_summary([90.0], [100.0], 0.95)["met"]


def test_the_table_has_every_contender_ratio_and_source() -> None:
    rates = {"three": [120.0, 130.0], "one": [125.0, 125.0], "hf": [80.0, 100.0]}
    cpu = {k: [1.0, 1.0] for k in rates}
    summary = summarize(rates, cpu, {"three": [50, 30, 20], "hf": [40, 40, 20]}, (5, 3, 2))
    assert summary["weights"] == {"a": 0.5, "b": 0.3, "c": 0.2}
    assert summary["realized_shares"]["hf"] == {"a": 0.4, "b": 0.4, "c": 0.2}
    text = format_table(summary, {"torchdata": "not installed"})
    for key in rates:
        assert f"| {TITLES[key]} | " in text
    assert f"| three sources / {TITLES['one']} | 1.00x | ±0.04 |" in text
    assert f"| three sources / {TITLES['hf']} | 1.40x | ±0.10 |" in text
    assert "| c | 0.200 | 0.200 | 0.200 |" in text
    assert f"skipped {TITLES['torchdata']}: not installed" in text


@pytest.mark.integration
def test_the_mixture_benchmark_runs_and_its_mixture_has_the_weights_asked(tmp_path: Path) -> None:
    out = tmp_path / "mixture.json"
    weights = ",".join(map(str, WEIGHTS))
    command = [
        sys.executable,
        "-m",
        "benchmarks.mixture",
        "--quick",
        "--weights",
        weights,
        "--json",
        str(out),
    ]
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for key in ("three", "one", "hf"):
        assert f"| {TITLES[key]} |" in done.stdout, f"a row for {key}, printed"
    assert "| three sources / dataferry, one source (--data) |" in done.stdout
    assert f"| three sources / {TITLES['hf']} |" in done.stdout
    record = json.loads(out.read_text())
    assert record["cleanup"] == {"service_exit_codes": [0, 0], "segments_left": 0, "workers_killed": 0}
    assert record["sources"] == {"a": 192, "b": 112, "c": 80}
    for key in ("three", "one", "hf"):
        assert len(record["rates"][key]) == 3 and min(record["rates"][key]) > 0
    for other in ("one", "hf"):
        assert record["ratios"][f"three_over_{other}"]["median"] > 0
    realized = record["realized_shares"]["three"]
    assert record["rows_counted"]["three"] == 3 * 4 * 64, "every timed batch counted, full batches"
    for name, weight in zip(NAMES, WEIGHTS, strict=True):
        # Every prefix of a mixture's epoch is within 0.75 of a sample of each share (NOTE [ Mixture
        # order ]): three timed windows of 256 rows cannot stray 15 rows from the weights.
        assert abs(realized[name] - weight) < 0.02, (name, realized, WEIGHTS)
