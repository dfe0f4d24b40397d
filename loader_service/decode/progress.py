"""How far each decode worker is in its task, sample by sample, on a small shared page.

NOTE [ Per-sample progress ]
    A worker that dies or hangs sends no report, and a batch used to be redone whole, then given up
    whole after three deaths: one file that crashed OpenCV or a pipeline call that never returned
    cost every sample of its batch, and took three task timeouts to do so. So each worker writes,
    after every sample, the task it works on and how many of its samples it has finished, into its
    own two words of a page the service made (one 8-byte store each, which the reader can never
    see half-done). When the worker dies or is killed, the service reads where it was: the sample
    at that position is the one it died on. A hang (no sample finished within the task timeout,
    which is therefore a time per sample) costs that sample at once; a crash costs it at its second
    crash (the first may have been the machine's, an OOM kill). Either way the task is redone
    without it, so the rest of its batch is delivered. A worker marks its task started (position
    0) before its first sample, so a death during that sample counts against it too; only one
    that died before even that (between taking the task and starting it) leaves the service
    nowhere to point, and its task is retried whole, up to ``MAX_TASK_ATTEMPTS`` (scheduler.py).

NOTE [ Waiting on the store ]
    A worker whose data is in an object store spends most of a slow task waiting for answers: a
    Parquet sample whose page map is new needs a request per page header, one after the other, and
    with a store answering in 0.3 s that is longer than the task timeout. Counting that as a hung
    decoder killed every worker and reported every sample bad, so a slow store lost whole epochs.
    So the third word of each worker counts the store's answers (``answered``; one per finished
    request and per chunk of a streamed object), and the service starts a worker's task timeout
    again whenever that count moves, as it does for a finished sample. A store that stops answering
    still ends the wait: every read has its deadline, half the task timeout, after which the task
    is handed back whole (NOTE [ Object store reads ]). And the position is -1 (``PREFETCHING``)
    while a task's reads are asked for before its first sample: a worker that dies then (an OOM
    while the batch's bytes arrive) blames no sample, since none of them had begun.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

WORDS = 3
"""Per worker: the task id, the samples of it finished, and the store's answers to it, ever."""
PREFETCHING = -1
"""The position of a task whose reads are under way before its first sample (NOTE [ Waiting on the
store ])."""


class ProgressBoard:
    """``workers`` rows of ``WORDS`` int64 in a file the service creates and every worker maps."""

    def __init__(self, path: Path, workers: int, create: bool = False) -> None:
        self.path = path
        size = max(1, workers) * WORDS * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words: npt.NDArray[np.int64] = np.ndarray((max(1, workers), WORDS), np.int64, self._map)
        if create:
            self._words[:, 0] = -1

    def start(self, worker: int, task: int, position: int = 0) -> None:
        """The worker took ``task``; ``position`` is 0, or ``PREFETCHING`` while its reads go first."""
        self._words[worker, 1] = position
        self._words[worker, 0] = task

    def finished(self, worker: int, done: int) -> None:
        """``done`` samples of the current task are finished (written or found bad)."""
        self._words[worker, 1] = done

    def answered(self, worker: int) -> None:
        """The store answered one more of this worker's requests (NOTE [ Waiting on the store ])."""
        self._words[worker, 2] += 1

    def read(self, worker: int) -> tuple[int, int]:
        """(task, samples finished) as the worker last wrote them; task -1 before its first, and
        samples ``PREFETCHING`` while its reads come before its first sample."""
        if not 0 <= worker < len(self._words):
            return -1, 0
        return int(self._words[worker, 0]), int(self._words[worker, 1])

    def answers(self, worker: int) -> int:
        """How many of its requests the store has answered this worker, ever."""
        if not 0 <= worker < len(self._words):
            return 0
        return int(self._words[worker, 2])

    def close(self) -> None:
        del self._words
        self._map.close()
