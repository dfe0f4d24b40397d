"""What a user runs from a folder other users can write in (/tmp, a shared project folder) imports
nothing planted there: neither the service nor any process it starts
(NOTE [ Nothing from the working folder ] in loader_service/working_folder.py). The trainer's
private service: tests/integration/test_local_service.py; the demo: tests/e2e/test_cli.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from tests.helpers import (
    ServiceFactory,
    child_of,
    console_script,
    epoch_indices,
    plant_packages,
    status,
    template_of,
    wait_until,
)

pytestmark = pytest.mark.e2e

USER_PIPELINE = """
import os

import numpy as np

with open({note!r}, "a") as note:  # who imported it: the template should have, once for all workers
    note.write(f"{{os.getpid()}}\\n")


def crop(sample, rng):
    return {{"image": np.ascontiguousarray(sample["image"][:8, :8].transpose(2, 0, 1)), "label": np.int64(0)}}
"""


def ready_workers(endpoint: str, other_than: frozenset[int] | set[int] = frozenset()) -> set[int]:
    """The pids of the service's two workers, once both are ready and neither is in ``other_than``."""
    found: set[int] = set()

    def ready() -> bool:
        nonlocal found
        found = {int(w["pid"]) for w in status(endpoint)["worker_list"] if w["ready"] and w["pid"]}
        return len(found) == 2 and found.isdisjoint(other_than)

    wait_until(ready, f"two ready workers, none of {sorted(other_than)}", timeout=60)
    return found


def an_epoch(endpoint: str) -> list[int]:
    with ServiceLoader(endpoint, timeout=60) as loader:
        seen, _ = epoch_indices(loader)
    return sorted(seen)


@pytest.mark.parametrize("transform", ["built-in", "module pipeline"])
def test_a_service_started_in_a_shared_folder_runs_nothing_planted_there(
    photos: Path, tmp_path: Path, start_service: ServiceFactory, transform: str
) -> None:
    """``loader-service serve`` run from a folder holding a planted ``multiprocessing``,
    ``loader_service`` and ``runpy``. The console script keeps the folder off its own path, but
    multiprocessing's children (the workers' template, the resource tracker) are ``python -c``, which
    puts it first: before the fix the template imported the planted ``multiprocessing`` and no
    worker ever started. The two are killed and started again, the same way. A
    ``package.module:FUNC`` pipeline is still looked for there (the user named it), and loaded
    once, by the template."""
    folder, marker, imported = tmp_path / "shared", tmp_path / "ran", tmp_path / "imported"
    plant_packages(folder, marker)
    flags: dict[str, object] = {"image_size": 32}
    if transform == "module pipeline":
        (folder / "userpipe.py").write_text(USER_PIPELINE.format(note=str(imported)))
        flags = {"pipeline": "userpipe:crop"}
    program = console_script("loader-service")
    assert program[0].endswith("loader-service"), "the console script, not python -m, which runs the plant"
    service = start_service(photos, cwd=folder, program=program, wait_ready=False, **flags)
    try:
        service.wait_for(r"ready: ", timeout=120)
        first = an_epoch(service.endpoint)
        template, forked = template_of(service), ready_workers(service.endpoint)
        for pid in (template, child_of(service, b"resource_tracker", "resource tracker")):
            os.kill(pid, signal.SIGKILL)
        workers = ready_workers(service.endpoint, other_than=forked)  # forked from a new template
        child_of(service, b"resource_tracker", "resource tracker")  # started again too
        second = an_epoch(service.endpoint)
        templates = (template, template_of(service))
    finally:
        assert not marker.exists(), f"a planted module ran: {marker.read_text()}"
    assert first == second == list(range(90)), "the real data's epochs, every image once in each"
    for pid in workers:  # where the user started the service: a pipeline's relative paths still hold
        assert Path(f"/proc/{pid}/cwd").resolve() == folder.resolve()
    if transform == "module pipeline":
        importers = imported.read_text().split()
        assert all(str(pid) in importers for pid in templates), "each template loaded the user's module"
