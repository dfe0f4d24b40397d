"""End to end: how ``loader-service serve`` reports the errors that stop it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.e2e


def serve(data: Path, tmp_path: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    """Run the service to its end; each test makes it stop by itself, so a hang is a failure."""
    args = ["serve", "--data", str(data), "--endpoint", f"ipc://{tmp_path}/x.sock", "--workers", "1"]
    return subprocess.run(
        [sys.executable, "-m", "loader_service", *args, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **env},
        check=False,
    )


def test_fatal_error_is_logged_with_its_traceback(photos: Path, tmp_path: Path) -> None:
    # At INFO, the default: the one run that crashes in production is the one that must be diagnosable.
    result = serve(photos, tmp_path, {"DATAFERRY_INJECT_FAULT": "main-loop"}, "--log-level", "INFO")
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: fault injected by DATAFERRY_INJECT_FAULT" in result.stderr


def test_bad_environment_value_exits_2_naming_the_variable(photos: Path, tmp_path: Path) -> None:
    result = serve(photos, tmp_path, {"DATAFERRY_BATCH_SIZE": "lots"})
    assert result.returncode == 2
    assert "DATAFERRY_BATCH_SIZE='lots' is not an integer" in result.stderr


def test_flag_beats_the_environment(photos: Path, tmp_path: Path) -> None:
    # Were the variable used, the service would refuse to start (exit 2); the flag lets it reach the
    # injected fault (exit 1) instead.
    env = {"DATAFERRY_WORKERS": "0", "DATAFERRY_INJECT_FAULT": "main-loop"}
    result = serve(photos, tmp_path, env)
    assert result.returncode == 1, result.stderr
    assert "workers=1 " in result.stderr


def test_a_network_endpoint_without_curve_refuses_to_start_saying_how_to_make_keys(
    photos: Path, tmp_path: Path
) -> None:
    result = serve(photos, tmp_path, {}, "--endpoint", "tcp://0.0.0.0:0")
    assert result.returncode == 2, result.stderr
    assert "loader-service keys --out DIR" in result.stderr and "--insecure-tcp" in result.stderr


def test_insecure_tcp_warns_at_start(photos: Path, tmp_path: Path) -> None:
    # The main loop fault stops the service right after start-up, after the warning was due.
    env = {"DATAFERRY_INJECT_FAULT": "main-loop"}
    result = serve(photos, tmp_path, env, "--endpoint", "tcp://0.0.0.0:0", "--insecure-tcp")
    assert result.returncode == 1, result.stderr
    assert "WITHOUT authentication or encryption" in result.stderr


def test_parquet_metadata_nested_too_deeply_exits_2_naming_the_file(tmp_path: Path) -> None:
    """A file's writer decides how deep its ``huggingface`` metadata JSON goes: too deep for the JSON
    reader is a bad dataset (exit 2, which systemd does not restart), not a crash (exit 1, restarted
    for ever)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    deep = b"[" * 100_000 + b"]" * 100_000
    table = pa.table({"image": [b"\xff\xd8"], "label": [0]}).replace_schema_metadata({"huggingface": deep})
    pq.write_table(table, tmp_path / "deep.parquet")
    result = serve(tmp_path / "deep.parquet", tmp_path, {})
    assert result.returncode == 2, result.stderr
    assert "deep.parquet" in result.stderr and "nested too deeply" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "1e308", "-2"])
def test_a_cpu_budget_that_is_no_number_of_cores_exits_2_naming_the_flag(
    photos: Path, tmp_path: Path, value: str
) -> None:
    """``--cpu-budget inf`` once crashed on start (exit 1, a traceback, restarted by systemd for ever):
    a value no host has is a mistake in the configuration, refused in one line that names its flag."""
    result = serve(photos, tmp_path, {}, "--workers", "auto", f"--cpu-budget={value}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "cpu_budget" in line]
    assert "(set by --cpu-budget)" in line
