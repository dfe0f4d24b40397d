"""CPU time and memory of a process and all its descendants, and our shared-memory segments.

CPU time comes from psutil when it is installed and from ``/proc/<pid>/stat`` otherwise (the two
read the same kernel counters). Memory always comes from ``/proc/<pid>/status``, because only there
is resident memory split into anonymous (the heap: where a leak shows) and shared-memory pages,
which every process mapping the slot pool counts again.

Processes may exit between listing and reading; they are skipped, never an error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.layout import SEGMENT_PREFIX

PROC = Path("/proc")
SHM = Path("/dev/shm")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIB = 2**20


def parse_stat(text: str) -> tuple[int, float]:
    """``/proc/<pid>/stat`` -> (parent pid, user + system CPU seconds).

    The command name (field 2) may contain spaces and parentheses, so fields are counted from the
    last ``)``: after it come state, ppid, ..., utime (field 14) and stime (field 15).
    """
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def parse_status_kib(text: str, key: str) -> int:
    """A ``Key:  1234 kB`` line of ``/proc/<pid>/status`` in KiB (0 when absent, as for kernel threads)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    return 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _parents() -> dict[int, int]:
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            text = _read(entry / "stat")
            if text is not None:
                parents[int(entry.name)] = parse_stat(text)[0]
    return parents


def tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (children of children included)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def _psutil() -> Any | None:
    """psutil if installed; imported by name so that neither mypy nor a run requires it."""
    return importlib.import_module("psutil") if importlib.util.find_spec("psutil") else None


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds consumed so far by ``pids`` (those that still exist)."""
    psutil = _psutil()
    total = 0.0
    for pid in pids:
        if psutil is not None:
            try:
                times = psutil.Process(pid).cpu_times()
                total += float(times.user + times.system)
            except psutil.Error:
                pass
            continue
        text = _read(PROC / str(pid) / "stat")
        total += parse_stat(text)[1] if text is not None else 0.0
    return total


@dataclass(frozen=True)
class Memory:
    """Resident memory summed over processes, in MiB: all of it, and the anonymous (heap) part."""

    rss_mib: float
    rss_anon_mib: float


def memory(pids: Iterable[int]) -> Memory:
    rss = anon = 0
    for pid in pids:
        text = _read(PROC / str(pid) / "status")
        if text is not None:
            rss += parse_status_kib(text, "VmRSS")
            anon += parse_status_kib(text, "RssAnon")
    return Memory(rss / 1024, anon / 1024)


def service_segments(service_pid: int) -> list[Path]:
    """The shared-memory segments a service created (their names carry its pid)."""
    prefix = f"{SEGMENT_PREFIX}{service_pid}-"
    try:
        return sorted(p for p in SHM.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def shm_mib(service_pid: int) -> float:
    """Memory the service's segments occupy in /dev/shm (allocated blocks, not apparent size)."""
    total = 0
    for path in service_segments(service_pid):
        try:
            total += path.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return total / MIB
