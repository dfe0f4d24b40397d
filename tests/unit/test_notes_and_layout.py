"""The map a reader follows stays true: every cited ``NOTE [ ... ]`` is defined somewhere, and every
module the layout section of docs/contributing.md names exists where it says, and every module of
the service, the trainer's package and ``protocol/`` is named there."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO

CITED = re.compile(r"NOTE \[ ([^\]]+?) \]")
DEFINED = re.compile(r'^(?:#|"""|\s)*NOTE \[ ([^\]]+?) \](?::.*)?$')
"""A definition opens a comment or docstring line: the name alone, or followed by a colon."""
SOURCES = (
    "protocol", "loader_service", "gpu_worker", "benchmarks", "tests", "deploy", "docs", "examples"
)  # fmt: skip


def source_files() -> list[Path]:
    files = [REPO / "README.md"]
    for top in SOURCES:
        files += [p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md", ".c") and p.is_file()]
    return files


def test_every_cited_note_is_defined() -> None:
    defined: set[str] = set()
    cited: dict[str, set[str]] = {}
    for path in source_files():
        for line in path.read_text(errors="replace").splitlines():
            if m := DEFINED.match(line.strip()):
                defined.add(m.group(1))
            for name in CITED.findall(line):
                cited.setdefault(name, set()).add(str(path.relative_to(REPO)))
    cited.pop("...", None)  # the README's description of the convention
    dangling = {name: sorted(where) for name, where in cited.items() if name not in defined}
    assert not dangling, f"notes cited but defined nowhere: {dangling}"


def layout_block() -> list[str]:
    text = (REPO / "docs" / "contributing.md").read_text()
    section = text.split("## Layout", 1)[1]
    return section.split("```", 2)[1].splitlines()


def named_modules() -> list[Path]:
    """Each ``name.py`` of the layout block, as a path: under the folder whose entry it is in."""
    named: list[Path] = []
    folders: list[tuple[int, str]] = []  # (indent, folder) of the entries above
    for line in layout_block():
        entry = line[:26].rstrip()
        if entry.strip():
            indent = len(entry) - len(entry.lstrip())
            folders = [(i, f) for i, f in folders if i < indent]
            first = entry.strip().split()[0].rstrip(",")
            if first.endswith("/") or ("/" in first and not first.endswith(".py")):
                folders.append((indent, first.rstrip("/")))
        base = Path(*[f for _, f in folders]) if folders else Path()
        for token in re.findall(r"[\w/]+\.py\b", line):
            named.append(Path(token) if "/" in token else base / token)
    return named


def test_every_module_the_layout_names_exists() -> None:
    missing = [str(path) for path in named_modules() if not (REPO / path).is_file()]
    assert not missing, f"the layout section names modules that do not exist: {missing}"


def test_the_layout_names_every_module_of_the_packages() -> None:
    named = set(named_modules())
    for package in ("gpu_worker", "protocol", "loader_service"):
        found = (REPO / package).rglob("*.py")
        modules = {p.relative_to(REPO) for p in found if not p.name.startswith("__")}
        assert modules <= named, (
            f"{package}/ modules the layout does not name: {sorted(map(str, modules - named))}"
        )
