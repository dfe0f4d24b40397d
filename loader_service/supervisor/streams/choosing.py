"""A weighted job's epoch order, chosen on a thread of the main process, so that no trainer's
weights can hold the main loop up.

NOTE [ Choosing off the main loop ]
    A mixture's epoch is chosen position by position (NOTE [ Mixture order ]): in C 10 ms for a
    million positions, 0.32 s for the largest epoch, and up to about 1.3 s for the epochs a weight
    schedule makes the service choose at once (``MAX_SCHEDULE_CHOICE``); in Python, where the C
    choice is not built, fifty times that. A trainer picks its weights, its epoch's length and its
    changes, and may attach again and again, so none of that runs in the main loop: a producer
    whose mixture's epoch is not chosen yet asks this module's one thread for it and wants no batch
    meanwhile (``Producer.order_ready``); the main loop wakes every ``TICK`` and plans from it once
    it is there. The C choice releases the GIL, so the loop serves every other trainer while it
    runs. A producer keeps at most one request: one for a plan or weights it no longer has is
    cancelled if it has not begun, so the queue holds at most one request per producer, and the
    requests of a trainer that left go with its stream. The loop waits ``CHOICE_WAIT`` (5 ms) for a
    request it has just made, which covers epochs of up to about half a million positions, and a
    stream that takes the next epoch's batches decoded ahead takes their chosen epoch with them.
"""

from __future__ import annotations

import functools
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from loader_service.dataset.mixture import Mixture, MixtureEpoch


@functools.cache
def _chooser() -> ThreadPoolExecutor:
    """Made at the first weighted job: a service without one starts no thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixture-order")


class Choice:
    """One producer's request: the epoch of a mixture it plans from, chosen on the thread."""

    def __init__(self, mixture: Mixture, epoch: int) -> None:
        self.mixture, self.epoch = mixture, epoch
        self._future: Future[MixtureEpoch] = _chooser().submit(mixture.epoch, epoch)

    def of(self, mixture: Mixture | None, epoch: int) -> bool:
        return self.epoch == epoch and self.mixture == mixture

    def done(self) -> bool:
        """Chosen (or failed): a request cancelled before it began is not done, it is asked again."""
        return self._future.done() and not self._future.cancelled()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def wait(self, timeout: float) -> bool:
        """Whether it is chosen within ``timeout`` seconds (the main loop never waits: ``done``)."""
        return not futures.wait([self._future], timeout).not_done

    def result(self) -> MixtureEpoch:
        """The chosen epoch (its error, if choosing failed); call once ``done``."""
        return self._future.result(timeout=0)

    def cancel(self) -> None:
        self._future.cancel()
