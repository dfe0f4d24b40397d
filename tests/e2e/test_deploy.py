"""Deployment end to end: ``systemd-analyze`` on the units, and ``status`` of a real service.

The units are checked on rendered copies whose ``ExecStart=`` names the console scripts installed
next to this interpreter, because ``systemd-analyze verify`` checks that the command exists. What
the units and the example config say is checked without running anything in
``tests/unit/test_deploy_files.py``; sd_notify, status rendering and metrics in ``tests/unit/``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader_service.tools.sample_data import make_sample_dataset
from loader_service.tools.status_view import query_status, render
from tests.helpers import REPO, ServiceFactory

pytestmark = pytest.mark.e2e

DEPLOY = REPO / "deploy"
INSTALLED_BIN = "/opt/dataferry/venv/bin/"
EXPOSURE_LIMIT = 4.0
ANALYZE_TIMEOUT = 60.0


# --- the units --------------------------------------------------------------------------------


def installed_scripts() -> Path:
    """The folder holding the ``loader-service`` and ``gpu-worker`` console scripts of this interpreter."""
    folder = str(Path(sys.executable).parent)
    found = [shutil.which(name, path=folder) for name in ("loader-service", "gpu-worker")]
    if None in found:
        pytest.skip(f"console scripts not installed next to {sys.executable} (pip install -e .)")
    return Path(folder)


def render_units(dest: Path) -> None:
    """Copy both units into ``dest`` with ``ExecStart=`` naming the installed scripts."""
    bin_dir = f"{installed_scripts()}/"
    for unit in ("loader-service@.service", "gpu-worker@.service"):
        text = (DEPLOY / unit).read_text()
        assert INSTALLED_BIN in text, f"{unit} does not run the scripts from {INSTALLED_BIN}"
        (dest / unit).write_text(text.replace(INSTALLED_BIN, bin_dir))


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    return subprocess.run(
        ["systemd-analyze", *args],
        capture_output=True,
        text=True,
        timeout=ANALYZE_TIMEOUT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trivially valid unit: if systemd-analyze cannot check even this here, the tests skip."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    folder = tmp_path_factory.mktemp("canary")
    unit = folder / "dataferry-canary.service"
    unit.write_text(f"[Unit]\nDescription=canary\n\n[Service]\nExecStart={sys.executable} -V\n")
    return unit


def require_verify(canary: Path) -> None:
    result = analyze("verify", "--man=no", str(canary))
    if result.returncode != 0 or result.stdout or result.stderr:
        pytest.skip(f"systemd-analyze verify does not work here (on a trivial unit): {result.stderr[-500:]}")


def require_offline_security(canary: Path) -> None:
    result = analyze("security", "--offline=true", "--no-pager", str(canary))
    if "Overall exposure level" not in result.stdout:
        pytest.skip(f"systemd-analyze security --offline does not work here: {result.stderr[-500:]}")


def test_systemd_analyze_verify_prints_nothing_for_both_units(canary: Path, tmp_path: Path) -> None:
    require_verify(canary)
    render_units(tmp_path)
    units = [str(tmp_path / f"{name}@train.service") for name in ("loader-service", "gpu-worker")]
    result = analyze("verify", "--man=no", *units)
    # verify exits 0 on unknown keys and bad values: any output at all is a failure.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_loader_unit_exposure_is_at_most_4(canary: Path, tmp_path: Path) -> None:
    require_offline_security(canary)
    render_units(tmp_path)
    unit = str(tmp_path / "loader-service@train.service")
    threshold = f"--threshold={EXPOSURE_LIMIT * 10:.0f}"  # in tenths: 40 is an exposure level of 4.0
    result = analyze("security", "--offline=true", "--no-pager", threshold, unit)
    match = re.search(r"Overall exposure level for loader-service@train\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= EXPOSURE_LIMIT, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


# --- the sandbox, applied to a process here ------------------------------------------------------

SANDBOXED_CONVOLUTION = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 38, 65, 1
settings = dict(arg.split("=", 1) for arg in sys.argv[1:])
if settings.get("NoNewPrivileges") == "yes":
    assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, ctypes.get_errno()
if settings.get("MemoryDenyWriteExecute") == "yes":  # what systemd >= 254 does for it
    assert libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) == 0, ctypes.get_errno()
if "UMask" in settings:
    os.umask(int(settings["UMask"], 8))
import torch
torch.set_num_threads(1)
image = torch.rand(1, 3, 64, 64)
blur = torch.full((3, 1, 3, 3), 1 / 9)
print(tuple(torch.nn.functional.conv2d(image, blur, groups=3).shape))
"""
APPLICABLE = ("NoNewPrivileges", "MemoryDenyWriteExecute", "UMask")
"""Settings of the loader unit a process can apply to itself, with the kernel's own mechanisms."""


def unit_settings(unit: str) -> list[str]:
    lines = (DEPLOY / unit).read_text().splitlines()
    return [line for line in lines if line.split("=", 1)[0] in APPLICABLE]


def convolve_under(settings: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SANDBOXED_CONVOLUTION, *settings],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def mdwe_available() -> bool:
    probe = "import ctypes; raise SystemExit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0))"
    return subprocess.run([sys.executable, "-c", probe], check=False, timeout=30).returncode == 0


def test_a_torch_convolution_runs_under_the_loader_units_sandbox() -> None:
    """oneDNN makes the kernels it writes executable; MemoryDenyWriteExecute= forbade it."""
    result = convolve_under(unit_settings("loader-service@.service"))
    assert result.returncode == 0 and "(1, 3, 62, 62)" in result.stdout, result.stderr[-2000:]


def test_the_sandbox_check_would_catch_memory_deny_write_execute() -> None:
    if not mdwe_available():
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3 or later)")
    result = convolve_under(["MemoryDenyWriteExecute=yes"])
    assert result.returncode != 0 and "could not create a primitive" in result.stderr


# --- status of a real service --------------------------------------------------------------------


def test_status_of_a_real_service(tmp_path: Path, start_service: ServiceFactory) -> None:
    data = tmp_path / "data"
    make_sample_dataset(data, classes=2, per_class=4, seed=3)
    service = start_service(data, workers=1, batch_size=4)
    deadline = time.monotonic() + 30
    while not (body := query_status(service.endpoint, timeout=10.0))["worker_list"][0]["ready"]:
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    text = render(body)
    assert re.search(r"^train +8 ", text, re.MULTILINE), text  # the feed's SAMPLES column
    assert re.search(r"^0 +\d+ +yes ", text, re.MULTILINE), text  # the worker's READY column
    assert "no trainers attached" in text and "1 decode worker(s)" in text
    assert service.stop() == 0
