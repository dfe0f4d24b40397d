"""The packages keep to their sides: the service never imports the trainer's package nor the
trainer the service's (type-checking and function-local imports count), ``protocol`` and
its ``pixels`` import neither, and ``loader-service status`` starts without torch."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.helpers import REPO

FORBIDDEN = {
    "loader_service": {"gpu_worker"},
    "gpu_worker": {"loader_service"},
    "protocol": {"loader_service", "gpu_worker"},
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
        str(path.relative_to(REPO)): sorted(crossed)
        for path in (REPO / package).rglob("*.py")
        if (crossed := imported_packages(path) & FORBIDDEN[package])
    }
    assert not crossing, f"{package} imports across the boundary: {crossing}"


def test_the_status_tool_and_the_trainer_package_start_without_torch() -> None:
    probe = (
        "import sys, gpu_worker, protocol.curve, loader_service.tools.status_view, loader_service.tools.cli\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_services_main_process_and_config_import_no_opencv() -> None:
    """NOTE [ The worker contract ]: only decode workers decode; every module of ``supervisor/`` and
    ``config/`` (and the command line) imported together leaves OpenCV out."""
    modules = sorted(
        module_name(p)
        for top in ("supervisor", "config")
        for p in (REPO / "loader_service" / top).rglob("*.py")
    )
    imports = "".join(f"import {m}\n" for m in [*modules, "loader_service.tools.cli"])
    probe = f"import sys\n{imports}print('cv2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "a module of the main process imports OpenCV"


PRODUCT = ("protocol", "loader_service", "gpu_worker")
KNOWN_CIRCLES: set[frozenset[str]] = set()
"""Circles left to break; none now. A new one fails the test."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The product modules importing ``path`` runs: each module named, and the packages above it
    (their ``__init__`` runs first), wherever the import stands. Not the packages above ``path``
    itself: Python has run those before it, so a package that imports its own modules is no circle."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & modules
    own = module_name(path).split(".")
    return found - {".".join(own[:k]) for k in range(1, len(own) + 1)}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_product() -> None:
    paths = [p for top in PRODUCT for p in (REPO / top).rglob("*.py")]
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    found = set(circles(graph))
    assert found <= KNOWN_CIRCLES, f"import circles: {[sorted(c) for c in found - KNOWN_CIRCLES]}"


MAX_MODULE_LINES = 400


def code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring (a module's,
    a class's, a function's, or one under an assignment) nor of a note in one."""
    tree = ast.parse(text)
    prose: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and stmt.end_lineno:
                prose.update(range(stmt.lineno, stmt.end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and number not in prose
    )


def test_code_lines_leave_out_docstrings_notes_and_comments() -> None:
    text = (
        '"""A module.\n\nNOTE: why\n    y\n"""\n\n# why\nX = 1\n"""X\'s meaning."""\n\n\n'
        'def f() -> None:\n    """Doc."""\n    return None\n'
    )
    assert code_lines(text) == 3


def test_no_product_module_is_over_400_code_lines() -> None:
    """A module that grows past this holds more than one job: split it along its own sections.
    Code lines count: a concept explained at length in its notes is not split for that."""
    long = {
        str(p.relative_to(REPO)): n
        for top in PRODUCT
        for p in (REPO / top).rglob("*.py")
        if (n := code_lines(p.read_text())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} code lines: {long}"


RETIRED = {
    "dispatcher": "the fleet pass (FleetPass, gpu_worker/fleet_pass.py)",
    "_dispatcher": "the fleet pass",
    "REMOTE_SCHEMES": "STORE_SCHEMES: remote means a trainer on another host",
    "worker_pool": "supervisor/workers/pool.py",
    "shardstream": "supervisor/streams/shard.py",
    "autosize": "supervisor/workers/sizing/controller.py",
    "pool_slots": "FeedConfig.slots and first_slots",
    "EXTRA_FEED_SLOTS": "automatic pools (FIRST_SLOTS)",
    "curvekeys": "protocol.curve (the wheel's top-level names are protocol, loader_service, gpu_worker)",
    "is_loopback_tcp": "protocol.curve.is_loopback, the one rule for both sides",
    "LOOPBACK_HOSTS": "protocol.curve.is_loopback",
    "Source": "Format (dataset/format.py): a source is a feed's named dataset, never a format",
    "SOURCES": "formats.FORMATS, the registry of formats",
    "TarSource": "TarFormat",
    "ListSource": "ListFormat",
    "ParquetSource": "ParquetFormat",
    "FolderSource": "FolderFormat",
    "Schedule": "Weighting (loader_service/dataset/mixture.py): a schedule is the task scheduler's",
    "MAX_SCHEDULE_CHOICE": "MAX_WEIGHTING_CHOICE",
}
"""Names a rename retired, and what took their place: no identifier of the product may use them again
(comments and strings may, where the word means something else)."""


def test_retired_names_stay_out_of_the_product() -> None:
    found = {}
    for top in PRODUCT:
        for path in (REPO / top).rglob("*.py"):
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            names = {t.string for t in tokens if t.type == tokenize.NAME}
            if hit := sorted(names & RETIRED.keys()):
                found[str(path.relative_to(REPO))] = hit
    assert not found, f"retired names in use ({RETIRED}): {found}"
