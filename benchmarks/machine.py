"""Facts about the machine a run came from, for the report: hardware and versions, nothing identifying.

Results are only comparable with their machine beside them; the hostname, user and paths are left
out on purpose, because the report is committed to ``docs/benchmarks/log.md``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` (x86) or ``Model``/``Hardware`` (ARM) line of /proc/cpuinfo."""
    for key in ("model name", "Model", "Hardware"):
        for line in cpuinfo.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return " ".join(value.split())
    return platform.processor() or "unknown"


def mem_total_gib(meminfo: str) -> float | None:
    """``MemTotal`` of /proc/meminfo in GiB."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_version(module: str) -> str:
    """``torch.__version__`` and the like: with the build's local tag (``+cpu``, ``+cu130``), which the
    distribution's version leaves out. torchvision is read only if this run imported it ((h))."""
    loaded = sys.modules.get(module)
    if loaded is None and module == "torch":
        import torch as loaded
    return str(getattr(loaded, "__version__", None) or _version(module))


def _opencv_version() -> str:
    import cv2

    return str(cv2.__version__)


def _shm_gib() -> float | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize / 2**30


def machine_facts() -> dict[str, str]:
    """CPU, cores, memory and the versions that decide the numbers."""
    ram = mem_total_gib(_read("/proc/meminfo"))
    shm = _shm_gib()
    return {
        "cpu": cpu_model(_read("/proc/cpuinfo")),
        "cores": str(os.cpu_count() or 0),
        "cores usable": str(len(os.sched_getaffinity(0))),
        "ram": f"{ram:.1f} GiB" if ram else "unknown",
        "/dev/shm": f"{shm:.1f} GiB" if shm else "unknown",
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": _torch_version("torch"),
        "torchvision": _torch_version("torchvision"),
        "opencv": _opencv_version(),
        "pillow": _version("pillow"),
        "numpy": _version("numpy"),
        "pyzmq": _version("pyzmq"),
        "psutil": _version("psutil"),
    }
