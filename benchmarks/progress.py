"""Progress while the benchmark runs: tqdm bars on a terminal, a few plain lines in a log.

Everything goes to stderr, so stdout carries only the result table. Bars would fill a CI log or a
file with carriage returns, so they are used only when stderr is a TTY.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """Prints ``label: done/total`` about every quarter, and once at the end."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = max(1, total)
        self.done = 0
        self._step = max(1, self.total // 4)
        self._started = time.monotonic()

    def update(self, n: int = 1) -> None:
        before, self.done = self.done, self.done + n
        if self.done // self._step != before // self._step and self.done < self.total:
            self._line()

    def close(self) -> None:
        self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        print(f"bench: {self.label}: {self.done}/{self.total} ({elapsed:.1f} s)", file=sys.stderr, flush=True)


def _tqdm(label: str, total: int) -> Any:
    """tqdm imported by name: it ships no type information, and this is the only place it is used."""
    tqdm = importlib.import_module("tqdm").tqdm
    return tqdm(total=total, desc=f"bench: {label}", file=sys.stderr, leave=False, dynamic_ncols=True)


def progress(label: str, total: int) -> Progress:
    """A bar on a terminal, plain lines otherwise."""
    if sys.stderr.isatty():
        try:
            bar: Progress = _tqdm(label, total)
            return bar
        except ImportError:
            pass
    return PlainProgress(label, total)


class LazyProgress:
    """A ``progress(done, total)`` callback that makes its bar on the first call, when the total is known."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Progress | None = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress(self.label, total)
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def say(message: str) -> None:
    """One line of narration: which scenario starts, what it found."""
    print(f"bench: {message}", file=sys.stderr, flush=True)
