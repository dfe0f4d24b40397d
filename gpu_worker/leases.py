"""Lease bookkeeping: which slot leases a trainer holds, which it has let go, which are still unsent.

A lease is named by ``(session incarnation, lease id)``: leases of a lost session are never sent to
its successor. Three sets matter:

    live      announced to this process, handed out as a batch, not yet let go
    released  let go (the last view of the slot died) but not yet taken for sending
    unsent    taken for sending, but the socket refused the message (ZeroMQ EAGAIN): sent again later

NOTE [ Releases that could not be sent ]
    A release that never reaches the service costs its credit for the rest of the session: the
    service only returns a slot on a release, a ``bye`` or a session timeout. So a release the socket
    refuses is kept, merged with later ones, and offered again at every send opportunity (each wait
    of the loop for a message, in short slices). Nothing blocks: each attempt is a non-blocking send.
    Two events end a kept release without sending it. A new session (the service restarted): the old
    leases died with the old session. A resumed session: the trainer named the leases it still holds
    in its hello and the service returned all the others itself, so sending them again would be a
    release of a lease the service no longer knows (ignored, but counted as rejected traffic). That
    resume also covers releases the old socket accepted but never delivered: they die with it.
    A refused ``start`` is kept the same way by the loader (only the latest: it supersedes the rest).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence

from protocol.messages import MAX_RELEASES, Release

log = logging.getLogger(__name__)
Lease = tuple[int, int]
"""(session incarnation, lease id)."""
SendRelease = Callable[[Release], bool]
"""Sends one message without blocking; False when the socket refused it."""
MAX_UNSENT = MAX_RELEASES
"""Lease ids kept for sending, so that one message always carries them all. A service that keeps its
credit promise never has more out than ``credits`` (at most 1024); beyond this one sends batches it
was not granted, and the oldest of its leases are forgotten."""


class LeaseBook:
    """The trainer's leases. ``let_go`` may run on any thread; everything else on the loader's."""

    def __init__(self) -> None:
        self._live: set[Lease] = set()
        # Appended to by finalizers on any thread; only ever drained or filtered in place, never
        # replaced, so a finalizer created before a reconnect still reaches the deque that is read.
        self._released: deque[Lease] = deque()
        self._unsent: dict[Lease, None] = {}  # insertion-ordered set

    def watch(self, owner: object, lease: Lease) -> None:
        """Hold ``lease`` until ``owner`` (the root of every view of its slot) is garbage.

        NOTE [ Slot lifecycle ]: the lease ends when ``owner`` dies, i.e. with the last view of it.
        """
        self.watch_all((owner,), lease)

    def watch_all(self, owners: Sequence[object], lease: Lease) -> None:
        """Hold ``lease`` until every one of ``owners`` is garbage: a batch that came over the socket
        has one root per frame (NOTE [ Batch fields: views and copies ] in gpu_worker/batch.py)."""
        if not owners:
            raise ValueError("a lease needs at least one owner")
        self._live.add(lease)
        # Finalizers run on whichever thread drops an owner. list.pop is atomic and pops 0 last, so
        # exactly one finalizer, the last to run, lets the lease go.
        left = list(range(len(owners)))

        def one_gone() -> None:
            if left.pop() == 0:
                self.let_go(lease)

        for owner in owners:
            fin = weakref.finalize(owner, one_gone)
            fin.atexit = False

    def let_go(self, lease: Lease) -> None:
        """Mark ``lease`` for release; the loader's thread sends it. Safe from any thread."""
        self._released.append(lease)

    def held(self) -> int:
        """Leases this trainer still references (delivered and not let go)."""
        return len(self._live - set(self._released))

    def held_ids(self, incarnation: int) -> tuple[int, ...]:
        """Lease ids of session ``incarnation`` still referenced: what a resuming hello names."""
        released = set(self._released)
        return tuple(lease for of, lease in self._live - released if of == incarnation)

    def unreleased_ids(self, incarnation: int) -> tuple[int, ...]:
        """Lease ids of session ``incarnation`` whose release has not gone out: held, or let go and
        not yet sent. What an ``ack`` names as held (NOTE [ Acknowledged delivery ])."""
        ids = {lease for of, lease in self._live if of == incarnation}
        ids.update(lease for of, lease in self._unsent if of == incarnation)
        return tuple(sorted(ids))

    def unreturned(self, incarnation: int) -> int:
        """Leases of session ``incarnation`` the service still counts against this trainer's
        credits, as far as it knows here: referenced, or let go with the release not yet sent.
        (Leases of an earlier session count against nothing: that session is gone.)"""
        return sum(1 for of, _ in self._live if of == incarnation) + sum(
            1 for of, _ in self._unsent if of == incarnation
        )

    @property
    def pending(self) -> bool:
        """Something is waiting to be sent."""
        return bool(self._released or self._unsent)

    def flush(self, incarnation: int, send: SendRelease) -> None:
        """Send every pending release of session ``incarnation`` in one message; keep them if refused."""
        self._take_released(incarnation)
        if not self._unsent:
            return
        if send(Release(tuple(lease for _, lease in self._unsent))):
            self._unsent.clear()
        else:
            log.debug("kept %d releases to send again", len(self._unsent))

    def resumed(self, incarnation: int, held: tuple[int, ...]) -> None:
        """The service kept only ``held`` of session ``incarnation`` and returned every other lease."""
        kept = set(held)

        def still_ours(lease: Lease) -> bool:
            return lease[0] != incarnation or lease[1] in kept

        self._live = {lease for lease in self._live if still_ours(lease)}
        self._unsent = {lease: None for lease in self._unsent if still_ours(lease)}
        for _ in range(len(self._released)):  # in place: finalizers may append meanwhile
            lease = self._released.popleft()
            if still_ours(lease):
                self._released.append(lease)

    def _take_released(self, incarnation: int) -> None:
        """Move what was let go into ``unsent``, dropping leases of sessions that are gone."""
        while self._released:
            lease = self._released.popleft()
            self._live.discard(lease)
            if lease[0] == incarnation:  # a lost session's leases died with it
                self._unsent[lease] = None
        for lease in [lease for lease in self._unsent if lease[0] != incarnation]:
            del self._unsent[lease]
        excess = len(self._unsent) - MAX_UNSENT
        if excess > 0:
            log.warning("the service sent more batches than granted; dropping %d unsent releases", excess)
            for lease in list(self._unsent)[:excess]:
                del self._unsent[lease]
