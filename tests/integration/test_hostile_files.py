"""Dataset entries that are not regular files, or too large, are bad samples, found without a hang.

Before ``read_file`` checked what it opens, a FIFO hung a decode worker until ``--task-timeout``
killed it (three times, losing its whole batch) and a link to /dev/zero read until memory ran out.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from tests.helpers import ServiceFactory, status

pytestmark = pytest.mark.integration

EPOCH_DEADLINE = 30.0
"""Far below the default --task-timeout (120 s): an epoch this fast had no worker stuck and killed."""

REASONS = {
    "b/fifo.jpg": "not a regular file: a FIFO",
    "b/zero.jpg": "not a regular file: a character device",
    "b/big.jpg": "bytes is over --max-file-bytes",
}


@pytest.fixture
def hostile(photos: Path, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """Good photos in ``a/``; in ``b/`` a FIFO, a link to /dev/zero and a decodable photo made larger
    than the limit by bytes after its end. Yields the data root and the ``--max-file-bytes`` to use."""
    root = tmp_path / "hostile"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    good = sorted(photos.glob("class_000/*.jpg"))[:9]
    for p in good:
        shutil.copy(p, root / "a" / p.name)
    limit = max(p.stat().st_size for p in good) + 1000
    os.mkfifo(root / "b" / "fifo.jpg")
    (root / "b" / "zero.jpg").symlink_to("/dev/zero")
    (root / "b" / "big.jpg").write_bytes(good[0].read_bytes() + b"\0" * limit)
    yield root, limit
    try:  # a writer releases a worker that a regression left blocked opening the FIFO
        os.close(os.open(root / "b" / "fifo.jpg", os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody was waiting


def test_fifos_devices_and_oversized_files_are_bad_samples_and_the_epoch_goes_on(
    hostile: tuple[Path, int], start_service: ServiceFactory
) -> None:
    root, limit = hostile
    index = build_index(root)
    relpaths = [index.relpath(i) for i in range(len(index))]
    bad = {i for i, rel in enumerate(relpaths) if rel in REASONS}
    assert len(bad) == len(REASONS), relpaths
    service = start_service(root, batch_size=4, augment="none", max_file_bytes=limit)
    started = time.monotonic()
    with ServiceLoader(service.endpoint, timeout=EPOCH_DEADLINE) as loader:
        seen = [i for batch in loader for i in batch.indices.tolist()]
    assert time.monotonic() - started < EPOCH_DEADLINE
    assert sorted(seen) == sorted(set(range(len(index))) - bad), "every good file once, no bad one"
    feed = status(service.endpoint)["feeds"][0]
    assert feed["bad_files"] >= len(REASONS)
    assert set(REASONS) <= set(feed["recent_bad_files"])
    for rel, reason in REASONS.items():
        line = service.wait_for(rf"bad sample skipped: {rel}: ").string
        assert reason in line, line
    assert status(service.endpoint)["worker_restarts"] == 0, "no worker got stuck and was killed"
    assert service.stop() == 0
