"""``python -m benchmarks.mixture_sharing --quick``: two jobs with different weights over the same
sources on one service share decodes through the sample cache, and only through it; a broadcast
group decodes once for both members (issue 38)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.mixture_sharing import CASES, Counts, JobResult, figures
from tests.helpers import REPO

pytestmark = pytest.mark.integration


def test_the_figures_count_a_broadcast_row_once_for_the_group_and_charge_the_warm_entries() -> None:
    group = next(c for c in CASES if c.broadcast)
    jobs = [JobResult(group.jobs[0], rows=64, samples={(0, i) for i in range(60)}) for _ in group.jobs]
    before = Counts(decoded=32, warm=32, hits=0, misses=0, entries=0, full=False, lock_timeouts=0, served=0)
    after = replace(before, decoded=32 + 64, served=128)
    got = figures(group, before, after, jobs, 1.0)
    assert (got["rows_delivered"], got["filled"], got["not_delivered"]) == (128, 64, 0)
    assert got["decodes_per_row"] == 0.5 and got["floor_per_row"] == 60 / 128

    cached = next(c for c in CASES if c.key == "two_cache")
    start = replace(before, misses=32, entries=32)
    end = replace(start, decoded=32 + 136, hits=70, misses=32 + 66, entries=32 + 64)
    jobs = [JobResult(w, rows=64, samples={(s, i) for i in range(48)}) for s, w in enumerate(cached.jobs)]
    got = figures(cached, start, end, jobs, 1.0)
    assert (got["file_decodes"], got["not_delivered"], got["decoded_twice"]) == (66, 8, 2)
    assert got["decodes_per_row"] == (66 + 32) / 128, "the warm start's entries are charged"


def test_the_sharing_benchmark_shows_the_cache_and_a_broadcast_group_sharing_decodes(tmp_path: Path) -> None:
    out = tmp_path / "sharing.json"
    command = [sys.executable, "-m", "benchmarks.mixture_sharing", "--quick", "--json", str(out)]
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(out.read_text())
    cases = record["cases"]
    for case in CASES:
        assert f"| {case.title} |" in done.stdout, f"a row for {case.key}, printed"
        got = cases[case.key]
        assert got["rows_by_job"] == [192] * len(case.jobs), "one whole epoch per job"
        assert got["rows_served_status"] == got["rows_delivered"], "the service's ledger agrees"
    assert record["cleanup"] == {
        "service_exit_codes": [0] * len(CASES),
        "segments_left": 0,
        "workers_killed": 0,
    }
    per_row = {key: c["decodes_per_row"] for key, c in cases.items()}
    assert per_row["two"] >= 0.95, "without a cache every row is decoded for its own job"
    assert per_row["broadcast"] <= 0.55, "a broadcast group decodes each batch once for its members"
    assert per_row["two_cache"] < per_row["two"], "the cache shares decodes between the jobs"
    assert cases["two_cache"]["cache_hits"] > 0 and not cases["two_cache"]["cache_full"]
    assert cases["two"]["distinct_samples"] == 192, "the two jobs' weights together read every sample"
