"""What weighted jobs' epoch orders may hold in the service together: a budget from the host's
memory, and the refusal of a job that would pass it (issue 45).

NOTE [ Orders' memory ]
    A weighted job's stream holds its epoch's order and the next one's (decoded ahead), each as
    marks (NOTE [ Epoch marks ]): ``held_bytes`` of its epoch's length and sources, 16 KiB for the
    largest epoch of three sources, 16 MiB of 256 (before marks, 96 MiB whatever the sources: 16
    jobs with weights of their own took a service from 47 MiB to 1585 MiB). Jobs with the same
    weights share one order, but every job may give weights of its own, so ``--order-memory``
    bounds what they may hold together: by default a sixteenth of the memory this process may use
    (the host's ``MemTotal``, or its cgroup's limit where lower: ``memory.max`` of cgroup v2 at its
    cgroup or a parent, ``memory.limit_in_bytes`` of v1). A hello whose job would pass it is
    refused, naming the budget, what the weighted jobs attached hold and what this one needs; a
    job without weights, or one joining a broadcast group (which reads the group's one order),
    needs nothing more. Each stream is counted as if it shared nothing: what is counted bounds
    what is held.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from loader_service.dataset.marks import held_bytes
from loader_service.dataset.mixture import Mixture

HOST_SHARE = 16
"""The share of the memory this process may use that orders may hold by default: one sixteenth."""
UNKNOWN_MEMORY = 8 * 2**30
"""What ``host_memory`` says where neither /proc/meminfo nor a cgroup limit can be read (a
sandbox): the service still starts, with a default budget of 512 MiB for orders."""


def host_memory(root: Path = Path("/")) -> int:
    """Bytes of memory this process may use: ``MemTotal``, or a cgroup's limit where lower."""
    found = [_meminfo_total(root)]
    for line in _read(root / "proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: this cgroup's limit and each parent's
            base = root / "sys/fs/cgroup"
            folder = base / path.lstrip("/")
            while folder != base.parent and folder.is_relative_to(base):
                found.append(_number(_read(folder / "memory.max")))
                folder = folder.parent
        elif "memory" in controllers.split(","):  # v1: its own folder, or the mount's root in a container
            for folder in (root / "sys/fs/cgroup/memory" / path.lstrip("/"), root / "sys/fs/cgroup/memory"):
                found.append(_number(_read(folder / "memory.limit_in_bytes")))
    return min((n for n in found if n > 0), default=UNKNOWN_MEMORY)


def _meminfo_total(root: Path) -> int:
    for line in _read(root / "proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _number(text: str) -> int:
    """A limit's bytes; 0 for none ("max", absent, unreadable)."""
    text = text.strip()
    return int(text) if text.isdigit() else 0


class OrderBudget:
    """What the weighted jobs' orders may hold together (NOTE [ Orders' memory ])."""

    def __init__(self, configured: int, memory: int | None = None) -> None:
        """``configured``: ``--order-memory`` (0: a ``HOST_SHARE`` of ``memory``, by default the
        memory this process may use)."""
        if configured:
            self.bytes, self.origin = configured, "--order-memory"
        else:
            memory = host_memory() if memory is None else memory
            self.bytes = memory // HOST_SHARE
            self.origin = f"1/{HOST_SHARE} of the host's {_size(memory)}; --order-memory sets it"

    @staticmethod
    def needs(mixture: Mixture) -> int:
        """What a job's stream holds: its epoch's order and the next one's."""
        return 2 * held_bytes(mixture.epoch_samples, len(mixture.sizes))

    def refusal(self, held: Iterable[Mixture], asked: Mixture) -> str | None:
        """Why a job reading ``asked`` cannot be attached beside jobs holding ``held``, or None."""
        holding = sum(self.needs(m) for m in held)
        needed = self.needs(asked)
        if holding + needed <= self.bytes:
            return None
        return (
            f"weighted jobs' epoch orders may hold {_size(self.bytes)} on this service "
            f"({self.origin}); the jobs attached hold {_size(holding)} and this job's epochs of "
            f"{asked.epoch_samples} samples over {len(asked.sizes)} sources need {_size(needed)}: "
            "choose a smaller epoch_samples, or attach once a weighted job has left"
        )


def _size(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
