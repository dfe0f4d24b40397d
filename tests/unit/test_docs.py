"""The docs site builds strictly and holds every ``serve`` flag; the README fits a screen's worth of
bytes and its links lead somewhere."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

from loader_service.config.options import OPTIONS
from loader_service.tools.cli import command_parser
from tests.helpers import REPO

README_LIMIT = 10_000
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def test_the_strict_site_build_lists_every_serve_flag(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)]
    built = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert built.returncode == 0, built.stdout + built.stderr
    flags_page = html.unescape((tmp_path / "reference" / "flags" / "index.html").read_text())
    forms = [s for a in command_parser("serve")._actions for s in a.option_strings if a.dest != "help"]
    assert {o.flag for o in OPTIONS.values()} <= set(forms) and "--no-strict" in forms
    missing = [flag for flag in forms if f"<code>{flag}</code>" not in flags_page]
    assert not missing, f"the flag reference lacks {missing}, which serve --help accepts"
    home = (tmp_path / "index.html").read_text()
    assert "ServiceLoader.local" in home, "the home page is the README"


def test_the_readme_fits_and_its_links_exist() -> None:
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= README_LIMIT, f"README.md is {len(readme)} bytes"
    targets = [t for t in LINK.findall(readme.decode()) if "://" not in t]
    assert targets, "the README links to the docs"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_generated_pages_in_docs_are_what_the_code_gives() -> None:
    """They are files too, so that their links work where the Markdown is read on a code host (they
    404ed there while only the site made them): an option or a note changed without them fails here."""
    sys.path.insert(0, str(REPO / "docs" / "hooks"))
    try:
        import generated
    finally:
        sys.path.pop(0)
    stale = [
        uri for uri, text in generated.committed_pages().items() if (REPO / "docs" / uri).read_text() != text
    ]
    assert not stale, f"{stale} differ from the code: run python docs/hooks/generated.py"
    links = [m.group(1) for page in (REPO / "docs").rglob("*.md") for m in LINK.finditer(page.read_text())]
    generated_only = set(generated.pages()) - {"index.md"}
    assert not [link for link in links if link.lstrip("./") in generated_only], (
        "a link a code host cannot follow"
    )
