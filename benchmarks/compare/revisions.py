"""Each revision compared, in an environment of its own: its source, its C extensions, the installed wheels.

A revision is a git commit (anything ``git rev-parse`` takes) or ``WORKTREE``, the checkout as it is
now, uncommitted changes included. A commit's tree is exported with ``git archive`` into
``CACHE/<sha>/src`` and its C extensions are built in place there; the work tree is used where it is
(an editable install already built them). Each gets ``CACHE/<name>/venv``, a virtual environment
whose only addition is a ``.pth`` line naming the site-packages of the interpreter running the
comparison: the dependencies are the installed wheels, shared, and only the product differs. The
editable install of the work tree is not seen there (``.pth`` files in a folder named by a ``.pth``
line are not run), so ``import loader_service`` finds the revision's own source, first on the path.
A commit's build is kept and reused by its sha.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

WORKTREE = "WORKTREE"
REPO = Path(__file__).resolve().parents[2]


class RevisionError(RuntimeError):
    """A revision could not be named or built; the message says which and why."""


@dataclass(frozen=True)
class Revision:
    """A built revision: what to run its code with."""

    name: str
    """As the user named it (``HEAD~1``, ``1579eba``, ``WORKTREE``)."""
    sha: str
    """The commit, or ``WORKTREE``."""
    src: Path
    python: Path

    @property
    def label(self) -> str:
        return self.name if self.sha == WORKTREE else f"{self.name} ({self.sha[:9]})"

    def env(self) -> dict[str, str]:
        """The environment a probe runs in: the revision's source first on the path."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "PYTHONPATH": str(self.src), "PYTHONDONTWRITEBYTECODE": "1"}


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], check=False, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RevisionError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def default_base() -> str:
    """The merge base of HEAD and the main branch (HEAD itself on main): what a change is measured from."""
    try:
        return git("merge-base", "HEAD", "main")
    except RevisionError:
        return "HEAD"


def build(name: str, cache: Path, log: list[str]) -> Revision:
    """``name`` built (or found built) under ``cache``; RevisionError if it cannot be."""
    if name == WORKTREE:
        return Revision(name, WORKTREE, REPO, _venv(cache / "worktree"))
    sha = git("rev-parse", "--verify", f"{name}^{{commit}}")
    home = cache / sha
    src = home / "src"
    if not (home / "built").exists():
        log.append(f"building {name} ({sha[:9]}) in {home}")
        shutil.rmtree(home, ignore_errors=True)
        _export(sha, src)
        _build_extensions(src, home / "build.log")
        (home / "built").touch()
    return Revision(name, sha, src, _venv(home))


def _export(sha: str, src: Path) -> None:
    src.mkdir(parents=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(src, filter="data")


def _build_extensions(src: Path, log: Path) -> None:
    """The revision's C extensions (region decoder, resampler), in place, as an editable install
    builds them. Optional in the product, so a failed build is logged and the revision runs without
    them, as it would for a user without a compiler."""
    with log.open("w") as out:
        subprocess.run(
            [sys.executable, "-c", "from setuptools import setup; setup()", "build_ext", "--inplace"],
            cwd=src,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )


def _venv(home: Path) -> Path:
    """A virtual environment in ``home`` that sees this interpreter's installed packages."""
    python = home / "venv" / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], check=True)
        site = Path(sysconfig.get_paths()["purelib"])
        target = Path(
            subprocess.check_output(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
            )
            .decode()
            .strip()
        )
        (target / "reuse-installed.pth").write_text(f"{site}\n")
    return python
