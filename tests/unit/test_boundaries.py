"""The packages keep to their sides: the service never imports the trainer's package nor the
trainer the service's (type-checking and function-local imports count), ``protocol`` imports
neither, and ``loader-service status`` starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

FORBIDDEN = {
    "loader_service": {"gpu_worker"},
    "gpu_worker": {"loader_service"},
    "protocol": {"loader_service", "gpu_worker", "curvekeys"},
    "curvekeys": {"loader_service", "gpu_worker", "protocol"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level names every import statement of the file names, wherever it is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_never_imports_the_other_side(package: str) -> None:
    crossing = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in (REPO / package).rglob("*.py")
        if imported_packages(path) & FORBIDDEN[package]
    }
    assert not crossing, f"{package} imports across the boundary: {crossing}"


def test_the_status_tool_and_the_trainer_package_start_without_torch() -> None:
    probe = (
        "import sys, gpu_worker, curvekeys, loader_service.tools.status_view, loader_service.tools.cli\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
