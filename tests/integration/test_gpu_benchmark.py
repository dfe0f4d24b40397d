"""``python -m benchmarks.gpu --device cpu --quick``: the GPU host's benchmark runs its whole code
path on CPU (a tiny model), so it keeps working where no GPU is; and its models are the ResNets they
claim to be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.resnet import make_model


@pytest.mark.parametrize(("name", "parameters"), [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_the_benchmarks_resnets_have_torchvisions_parameter_counts(name: str, parameters: int) -> None:
    model, _source = make_model(name)
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_the_gpu_benchmark_runs_on_cpu_and_reports_every_feed(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "gpu.json").read_text())
    feeds = [row["feed"] for row in record["rows"]]
    assert feeds[0] == "synthetic" and feeds[1].startswith("DataLoader (")
    decodes = ("service", "auto", "trainer")  # a row each, the service's decode first (issue 46)
    assert [feed.split(" (")[0] for feed in feeds[2:]] == [f"dataferry, decode={d}" for d in decodes], feeds
    for row in record["rows"]:
        assert row["images_per_s"] > 0 and 0 <= row["exposed_wait"] < 1 and row["cpu_cores"] > 0
    assert record["rows"][0]["of_synthetic"] == 1.0
    assert record["copy_gb_per_s"] == {}, "no host-to-device copy is timed on CPU"
    assert "| tiny | dataferry, decode=auto (share " in done.stdout, "one table, printed"
