"""A service host's install: dataferry alone, no torch, in a fresh venv, serves a batch to a trainer
(which has torch) as any service does. What the service image and a systemd host install."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from tests.helpers import REPO, ServiceProcess

pytestmark = pytest.mark.e2e
DOCKERFILE = REPO / "deploy" / "kubernetes" / "Dockerfile"


def image_sources() -> tuple[str, ...]:
    """What the service image's build stage copies from the checkout (its ``COPY`` lines, not those
    ``--from`` another stage): the install here reads exactly that, never the venv or caches."""
    names: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--"):
            names += [word.rstrip("/") for word in words[1:-1]]
    return tuple(names)


SOURCES = image_sources()
INSTALL_TIMEOUT = 600


def fresh_install(folder: Path) -> Path:
    """``pip install`` of the checkout's sources into a new venv; its interpreter."""
    source = folder / "src"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(REPO / name, source / name)
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", "-q"]
    installed = subprocess.run(
        [*pip, str(source)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


def test_a_service_host_installs_without_torch_and_serves_a_batch(photos: Path, tmp_path: Path) -> None:
    python = fresh_install(tmp_path)
    probe = (
        "import importlib.util as u, loader_service\n"
        "print(u.find_spec('torch') is None, loader_service.__file__)"
    )
    found = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    no_torch, where = found.stdout.split()
    assert no_torch == "True", "the service's install pulled torch"
    assert where.startswith(str(tmp_path / "venv")), f"not the fresh install's package: {where}"
    endpoint = f"ipc://{tmp_path}/service.sock"
    flags = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--log-level", "INFO"]
    service = ServiceProcess(
        ["serve", "--data", str(photos), "--endpoint", endpoint, *flags],
        endpoint,
        python=str(python),
        cwd=tmp_path,
    )
    try:
        service.wait_for(r"ready: ", timeout=60)
        with ServiceLoader(endpoint, timeout=60) as loader:
            batch = next(iter(loader))
            assert tuple(batch.images.shape) == (8, 3, 32, 32) and int(batch.images.float().std()) > 0
        assert service.stop() == 0
    finally:
        service.kill_group()
