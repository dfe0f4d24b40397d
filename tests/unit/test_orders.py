"""What weighted jobs' orders may hold (NOTE [ Orders' memory ]): the host's memory as a cgroup
bounds it, and a job past the budget refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader_service.dataset.marks import held_bytes
from loader_service.dataset.mixture import Mixture, integer_weights
from loader_service.supervisor.streams.orders import HOST_SHARE, UNKNOWN_MEMORY, OrderBudget, host_memory
from protocol.weights import MAX_EPOCH_SAMPLES
from tests.helpers import fake_root


def host(root: Path, files: dict[str, str]) -> Path:
    return fake_root(root, {"proc/meminfo": "MemTotal:       16384000 kB\nMemFree: 1 kB\n", **files})


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, 16384000 * 1024),
        ({"proc/self/cgroup": "0::/\n"}, 16384000 * 1024),
        (
            {
                "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
                "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
                "sys/fs/cgroup/kubepods/pod1/memory.max": "2147483648\n",  # the pod's, above it
                "sys/fs/cgroup/kubepods/memory.max": "8589934592\n",
            },
            2 * 2**30,
        ),
        (
            {
                "proc/self/cgroup": "12:cpu,cpuacct:/x\n4:memory:/docker/abc\n",
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "1073741824\n",  # a container's root
            },
            2**30,
        ),
        (
            {
                "proc/self/cgroup": "4:memory:/\n",
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # none
            },
            16384000 * 1024,
        ),
    ],
    ids=["no-cgroup", "v2-root", "v2-parent-limit", "v1-container", "v1-unlimited"],
)
def test_the_memory_a_service_may_use_is_the_tightest_limit(
    tmp_path: Path, files: dict[str, str], expected: int
) -> None:
    assert host_memory(host(tmp_path, files)) == expected


def job(epoch_samples: int, sources: int = 3, share: float = 1.0) -> Mixture:
    names = "abcdefgh"[:sources]
    weights = integer_weights({n: share if i == 0 else 1.0 for i, n in enumerate(names)}, names)
    return Mixture.of((90,) * sources, 0, epoch_samples, weights)


def test_jobs_are_attached_while_their_orders_fit_and_the_next_is_refused_by_name() -> None:
    largest = job(MAX_EPOCH_SAMPLES)
    assert OrderBudget.needs(largest) == 2 * held_bytes(MAX_EPOCH_SAMPLES, 3) < 40 * 2**10
    budget = OrderBudget(3 * OrderBudget.needs(largest))
    held = [job(MAX_EPOCH_SAMPLES, share=s) for s in (1.0, 2.0, 3.0)]
    assert budget.refusal(held[:2], held[2]) is None
    why = budget.refusal(held, job(MAX_EPOCH_SAMPLES, share=4.0))
    assert why is not None and "--order-memory" in why and "16777216 samples over 3 sources" in why
    assert budget.refusal(held[1:], job(1000)) is None, "a smaller epoch may fit where a large did not"


def test_by_default_a_share_of_the_hosts_memory() -> None:
    budget = OrderBudget(0, memory=64 * 2**30)
    assert budget.bytes == 64 * 2**30 // HOST_SHARE
    assert "1/16 of the host's 65536.0 MiB" in budget.origin
    assert OrderBudget(0).bytes > 0, "this host's memory, read"


def test_a_host_whose_memory_cannot_be_read_still_gets_a_budget(tmp_path: Path) -> None:
    """No /proc/meminfo, no cgroup files (a sandbox): a stated default, not a failed start."""
    assert host_memory(tmp_path) == UNKNOWN_MEMORY
