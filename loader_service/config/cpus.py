"""The CPUs this process may use: its affinity and its cgroup's CPU quota (v1 and v2).

NOTE [ CPU budget ]
    A default worker count must come from the host the service runs on, not from the machine it was
    written on: a container or a systemd unit with ``CPUQuota=`` may use fewer cores than the host
    has, and an affinity mask (``taskset``, ``CPUAffinity=``) fewer still. The budget is the least of
    * the CPUs in this process's affinity mask (``os.sched_getaffinity``),
    * every cgroup v2 ``cpu.max`` quota from this process's cgroup up to the root (the tightest
      applies: a pod's limit sits above the container's cgroup),
    * a cgroup v1 ``cpu.cfs_quota_us / cpu.cfs_period_us`` of this process's cpu controller,
    in cores, and may be a fraction (``CPUQuota=150%`` gives 1.5). ``--cpu-budget`` sets it instead,
    to keep cores for a trainer on the same host. Files that are missing or unreadable count as no
    limit: a host without cgroups is limited by its affinity alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Budget:
    cores: float
    """CPU time this process may use per second of wall time."""
    source: str
    """Which limit set it, for the log: "affinity (16 CPUs)", "cgroup v2 cpu.max (4.0)"..."""


def cpu_budget(root: Path = Path("/")) -> Budget:
    """This process's CPU budget (NOTE [ CPU budget ]); ``root`` stands for ``/`` in tests."""
    cpus = len(os.sched_getaffinity(0))
    found = [Budget(float(cpus), f"affinity ({cpus} CPUs)")]
    cgroup = _read(root / "proc/self/cgroup")
    if cgroup:
        found += _v2_limits(root, cgroup) + _v1_limits(root, cgroup)
    return min(found, key=lambda b: b.cores)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _v2_limits(root: Path, cgroup: str) -> list[Budget]:
    """``cpu.max`` of the cgroup v2 path and each of its parents: "max 100000" or "QUOTA PERIOD"."""
    paths = [line[3:] for line in cgroup.splitlines() if line.startswith("0::")]
    if not paths:
        return []
    base = root / "sys/fs/cgroup"
    found = []
    folder = Path(paths[0].strip() or "/")
    for part in [folder, *folder.parents]:
        cores = _quota(_read(base / part.relative_to("/") / "cpu.max").split())
        if cores is not None:
            found.append(Budget(cores, f"cgroup v2 cpu.max of {part} ({cores:g} cores)"))
    return found


def _v1_limits(root: Path, cgroup: str) -> list[Budget]:
    """``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the v1 cpu controller: the cgroup's own
    folder, or the mount's root where a container sees only its own cgroup there."""
    for line in cgroup.splitlines():
        _id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" not in controllers.split(","):
            continue
        for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
            base = root / "sys/fs/cgroup" / mount
            for folder in (base / path.strip().lstrip("/"), base):
                quota = _read(folder / "cpu.cfs_quota_us").split()
                period = _read(folder / "cpu.cfs_period_us").split()
                cores = _quota(quota + period) if quota and period else None
                if cores is not None:
                    return [Budget(cores, f"cgroup v1 cpu.cfs_quota_us ({cores:g} cores)")]
    return []


def _quota(words: list[str]) -> float | None:
    """QUOTA PERIOD in microseconds as cores; None for no limit ("max", -1) or anything unreadable."""
    if len(words) != 2 or words[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(words[0]), int(words[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None
