"""``python -m benchmarks.compare`` end to end on a tiny scenario: it builds a commit in an environment
of its own, runs the probe under both revisions and prints its rows (no figure is judged here: a test
on this machine cannot tell a change from noise; the benchmark's run can)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def test_compare_quick_builds_a_commit_and_reports_each_scenario(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.compare", "HEAD", "WORKTREE", "--quick", "--json"]
    command += ["--scenarios", "cold", "--rounds", "1", "--images", "64"]
    command += ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr  # 1: it judged a slide, which noise here may fake
    (row,) = json.loads(done.stdout)
    assert row["name"] == "cold" and row["unit"] == "s" and not row.get("error"), row
    assert 0 < row["a"] < 30 and 0 < row["b"] < 30 and row["ratio"] > 0
    record = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert record["b"] == "WORKTREE" and record["a"].startswith("HEAD (")
    (only,) = record["scenarios"]["cold"]["per_round"]
    assert only["a"]["value"] == row["a"] and only["b"]["value"] == row["b"]
    built = list((tmp_path / "cache" / "revisions").glob("*/src/loader_service/__init__.py"))
    assert len(built) == 1, "HEAD exported into its own folder"


def test_a_revision_that_does_not_exist_exits_2_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "no-such-revision", "--cache", str(tmp_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "no-such-revision" in done.stderr
