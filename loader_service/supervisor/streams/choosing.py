"""A weighted job's epoch order, chosen on a thread of the main process, so that no trainer's
weights can hold the main loop up, and no trainer's requests can hold up another's.

NOTE [ Choosing off the main loop ]
    A mixture's epoch is chosen position by position (NOTE [ Mixture order ]): in C 10 ms for a
    million positions, 0.3 s for the largest epoch, and up to about 1.3 s for the epochs a
    weighting makes the service choose at once (``MAX_WEIGHTING_CHOICE``); in Python, where the C
    choice is not built, fifty times that. A trainer picks its weights, its epoch's length and its
    changes, and may attach again and again, so none of that runs in the main loop: a producer
    whose mixture's epoch is not chosen yet asks this module's one thread for it and wants no batch
    meanwhile (``Producer.order_ready``); the main loop wakes every ``TICK`` and plans from it once
    it is there. The C choice releases the GIL, so the loop serves every other trainer while it
    runs. The loop waits ``CHOICE_WAIT`` (5 ms) for a request it has just made when the thread
    takes it at once (nothing else queued), which covers epochs of up to about half a million
    positions, and a stream that takes the next epoch's batches decoded ahead takes their chosen
    epoch with them.

    What one trainer may cost the others here (issue 45: a burst of 367 hellos from one connection
    once held another job's first batch up for 101.7 s, and a stop for 45.5 s):
    * A request that nobody wants any more is gone before it runs: a producer cancels its request
      when it moves to another plan or weights, and a stream cancels its own and its ahead's when
      it closes (its trainer left, or said hello again). Cancelling takes the request out of the
      queue; one being chosen stops at its next chunk (NOTE [ Epoch marks ]).
    * Requests wait in a queue per requester (a stream: one trainer, or one broadcast group), and
      the thread takes the queues in turn, one request each, so a trainer's requests can delay
      another trainer's by one choice at most. A requester has at most ``QUEUED_PER_REQUESTER``
      requests queued (a stream's epoch and its next one, decoded ahead): a producer asking past
      that is answered as cancelled and asks again at the next tick.
    * Identical requests (the same mixture and epoch: its weights, weighting, length and the
      sources' sizes) share one request; one whose order another order alive already holds (every
      epoch of the same weights has the same marks) is answered at once, without the thread.
    * The thread is a daemon and stops at exit, between two chunks: a stop never waits for the
      queue (``stop``).
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable

from loader_service.dataset.mixture import Mixture, MixtureEpoch

QUEUED_PER_REQUESTER = 2
"""Requests one requester may have queued: a stream asks for its epoch, and for the next one
decoded ahead; a third would be for a plan it left (NOTE [ Choosing off the main loop ])."""


class _Request:
    """One epoch of one mixture to choose, and whoever waits for it."""

    def __init__(self, mixture: Mixture, epoch: int, requester: Hashable) -> None:
        self.key = (mixture, epoch)
        self.mixture, self.epoch, self.requester = mixture, epoch, requester
        self.waiting = 1
        """Choices that want it."""
        self.finished = threading.Event()
        self.result: MixtureEpoch | None = None
        self.error: BaseException | None = None
        self.dropped = False
        """Nobody wants it any more, or the service stops: it is not chosen (or stops being)."""
        self.next_up = False
        """Queued when nothing else was: the thread takes it at once (worth a wait, ``CHOICE_WAIT``)."""

    def going(self) -> bool:
        return not self.dropped

    @property
    def given_up(self) -> bool:
        """Answered without an epoch or an error: dropped, or refused (its requester's queue full)."""
        return self.finished.is_set() and self.result is None and self.error is None

    def answer(self, result: MixtureEpoch | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.dropped = self.dropped or (result is None and error is None)
        self.finished.set()


class Chooser:
    """The one thread that chooses, and its queues: one per requester, taken in turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queues: OrderedDict[Hashable, deque[_Request]] = OrderedDict()
        self._pending: dict[tuple[Mixture, int], _Request] = {}
        """Queued or being chosen, by what is chosen."""
        self._stopping = False
        self._thread: threading.Thread | None = None

    def ask(self, mixture: Mixture, epoch: int, requester: Hashable) -> _Request:
        """A request for ``epoch`` of ``mixture``: shared with an identical one, answered at once
        if its order is held already, or queued (dropped if ``requester`` has its fill queued)."""
        with self._lock:
            shared = self._pending.get((mixture, epoch))
            if shared is not None and not shared.dropped:
                shared.waiting += 1
                return shared
            request = _Request(mixture, epoch, requester)
            known = mixture.known(epoch)
            if known is not None or self._stopping:
                request.answer(known)
                return request
            queue = self._queues.setdefault(requester, deque())
            if len(queue) >= QUEUED_PER_REQUESTER:
                request.answer(None)
                return request
            request.next_up = not self._pending
            queue.append(request)
            self._pending[request.key] = request
            self._start()
            self._wake.notify()
            return request

    def cancel(self, request: _Request) -> None:
        """One choice no longer wants ``request``: the last one takes it out of its queue."""
        with self._lock:
            request.waiting -= 1
            if request.waiting > 0 or request.finished.is_set():
                return
            request.dropped = True
            queue = self._queues.get(request.requester)
            if queue is not None and request in queue:
                queue.remove(request)
                if not queue:
                    del self._queues[request.requester]
                self._pending.pop(request.key, None)
                request.answer(None)
            # else it is being chosen: the walk stops at its next chunk, and _finish answers it

    def stop(self) -> None:
        """Choose nothing more: queued requests are dropped, the one being chosen stops at its next
        chunk. Called at exit."""
        with self._lock:
            self._stopping = True
            for queue in self._queues.values():
                for request in queue:
                    request.dropped = True
                    request.answer(None)
            self._queues.clear()
            for request in self._pending.values():
                request.dropped = True
            self._pending.clear()
            self._wake.notify_all()

    @property
    def queued(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mixture-order", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def _next(self) -> _Request | None:
        """The first request of the next requester in turn (it goes to the back); None to stop."""
        with self._lock:
            while not self._queues and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            requester, queue = next(iter(self._queues.items()))
            request = queue.popleft()
            del self._queues[requester]
            if queue:
                self._queues[requester] = queue
            return request

    def _run(self) -> None:
        while (request := self._next()) is not None:
            try:
                chosen = request.mixture.choose(request.epoch, request.going)
            except Exception as exc:  # the producer raises it where it plans (a bug: never a peer's)
                self._finish(request, None, exc)
            else:
                self._finish(request, chosen, None)

    def _finish(self, request: _Request, chosen: MixtureEpoch | None, error: BaseException | None) -> None:
        with self._lock:
            if self._pending.get(request.key) is request:
                del self._pending[request.key]
            request.answer(None if request.dropped else chosen, None if request.dropped else error)


@functools.cache
def chooser() -> Chooser:
    """The service's one chooser; its thread starts at the first request that waits for it."""
    return Chooser()


class Choice:
    """One producer's request: the epoch of a mixture it plans from, chosen on the thread."""

    def __init__(
        self, mixture: Mixture, epoch: int, requester: Hashable = None, on: Chooser | None = None
    ) -> None:
        self.mixture, self.epoch = mixture, epoch
        self._chooser = on or chooser()
        self._request = self._chooser.ask(mixture, epoch, requester)
        self._cancelled = False

    def of(self, mixture: Mixture | None, epoch: int) -> bool:
        return self.epoch == epoch and self.mixture == mixture

    @property
    def next_up(self) -> bool:
        """Whether the thread takes it at once: nothing else was queued or being chosen."""
        return self._request.next_up

    def done(self) -> bool:
        """Chosen (or failed): a request dropped before it was chosen is not done, it is asked again."""
        return self._request.finished.is_set() and not self.cancelled()

    def cancelled(self) -> bool:
        return self._cancelled or self._request.given_up

    def wait(self, timeout: float) -> bool:
        """Whether it is chosen within ``timeout`` seconds (the main loop never waits: ``done``)."""
        return self._request.finished.wait(timeout) and self.done()

    def result(self) -> MixtureEpoch:
        """The chosen epoch (its error, if choosing failed); call once ``done``."""
        request = self._request
        if request.error is not None:
            raise request.error
        assert request.result is not None, "a choice's result asked before it was chosen"
        return request.result

    def cancel(self) -> None:
        """Not wanted any more: out of the queue if nobody else waits for it (once: idempotent)."""
        if not self._cancelled:
            self._cancelled = True
            self._chooser.cancel(self._request)
