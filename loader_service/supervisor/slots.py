"""The slot pool: which batch slots of the shared-memory segment are free, being filled, ready or leased.

NOTE [ Slot lifecycle ]
    A slot moves only along these edges, and only the service's main thread moves it:

        FREE --acquire--> FILLING --filled--> READY --lease--> LEASED --release--> FREE
                             |                  |
                             +----cancel--------+----cancel----> FREE

    * FILLING: exactly one decode task owns the slot; nobody else reads or writes it. A worker writes
      rows and the labels/indices arrays, then reports ``done``; the slot is never announced before that
      report, so a trainer can never see a half-written batch.
    * READY: the batch is complete and waits to be announced in order (batches reach a trainer in
      sequence order, whichever worker finished first).
    * LEASED: announced to a trainer under a lease id. The service never writes it until the lease
      comes back: on the trainer's ``release`` (CPU: when the last tensor viewing it is freed; CUDA:
      when the device copy has completed), on ``bye``, or when the trainer's heartbeat times out.
    * cancel: a trainer restarted its epoch or left; a FILLING slot whose task is still running is
      freed when that task reports (the worker may still be writing until then), a READY one at once.
    A slot is reused only from FREE, so no trainer can be handed memory that another still reads.
    * remote trainers (TCP) are sent a copy of the slot's bytes, never the slot itself (NOTE
      [ Remote sends ] in trainers/sends.py), so nothing but a lease keeps a slot out of FREE.

NOTE [ A pool as large as what is in flight ]
    A slot is only ever taken for a batch some trainer asked for (its stream's window of credits,
    the next epoch's first batches inside that window) or for the feed's few warm-start batches, so
    the slots a feed needs are what its trainers can hold, not what its host has cores for. The
    segment is sized for ``capacity`` slots (address space only: a file's size on tmpfs costs no
    memory), and memory is reserved (``posix_fallocate``) for the first ``len(pool)`` slots. When a
    trainer's batch finds no free slot, the pool grows by one reserved slot, up to the capacity and
    above the /dev/shm floor (NOTE [ A /dev/shm floor ] in loader_service/shm.py), and when it has
    been mostly free for a while it gives its top slots back (NOTE [ Giving slots back ]). So:
    * slots ``0 .. len(pool) - 1`` are backed by memory, and no other slot is ever handed out: a
      worker or a trainer never touches a page that is not reserved (no SIGBUS on a full /dev/shm);
    * a trainer that sees slot ``s`` may take every slot below it as backed (it pins them for CUDA);
    * a growth /dev/shm cannot hold, or that would leave less than its floor free, is refused
      (counted, logged): trainers then share the slots there are, as they shared a fixed pool;
    * the lowest free slot is handed out first, so what is in use gathers at the bottom and the
      top stays free to be given back.

NOTE [ Giving slots back ]
    A pool that grew for a trainer that has gone (a peer that held hundreds of slots, a job's DDP
    ranks) would otherwise keep that memory out of /dev/shm for as long as the service runs. So at
    housekeeping, once per ``after`` seconds (twice the client timeout, 30 s by default: a silent
    trainer's slots have come back by then), the pool looks at the most slots it had in use at once
    since it last looked (``peak``). If that is at most half of it, it gives back its top slots,
    down to twice that peak (the same half free again: what keeps it from growing and shrinking by
    turns) and never below its first size (``--slots``, or the 8 an automatic pool starts with).
    Only a FREE slot goes, from the top down, so never one being filled, ready, announced or leased
    (NOTE [ Slot lifecycle ]); its memory is punched out of the segment (``Segment.give_back``),
    so /dev/shm has it back, and slots ``0 .. len(pool) - 1`` stay exactly the backed ones.
    Nor does a slot go that a trainer on this host may have pinned: one that uses CUDA registers
    every slot up to the highest it was handed, once (gpu_worker/delivery.py), and a range punched
    under it would stay pinned and be stale to its copies if that slot came back. So a session that
    maps the pool (``Session.pinned_through``) keeps every slot below the highest it was handed
    until it ends; a remote one (``transport=tcp``) holds none. So a trainer that was handed a slot
    above another's while that one held many (it attached then, or wanted a batch while no slot
    was free: at its epoch's start, say) keeps the pool that large until it leaves; then all of it
    comes back. Counted as the feed's ``pool_given_back``, logged.
"""

from __future__ import annotations

import enum
import heapq
import logging
import time
from collections.abc import Callable
from typing import Protocol

from loader_service.logs import LogLimiter

log = logging.getLogger(__name__)
GROW_RETRY = 1.0
"""Seconds a refused growth waits before the pool tries again: the scheduler asks whenever a batch
finds no free slot, and a statvfs, a count and a log line each time would be too many."""


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    READY = "ready"
    LEASED = "leased"


class SlotStateError(RuntimeError):
    """A transition that NOTE [ Slot lifecycle ] forbids; always a bug in the service."""


class Backing(Protocol):
    """The memory behind a pool's slots (``shm.Segment``): what grows and is given back."""

    def reserve(self, offset: int, nbytes: int) -> bool: ...

    def give_back(self, offset: int, nbytes: int) -> None: ...


class _Unbacked:
    """A pool of slots whose memory is always there (one whose size never changes, in tests)."""

    def reserve(self, offset: int, nbytes: int) -> bool:
        return True

    def give_back(self, offset: int, nbytes: int) -> None:
        pass


class SlotPool:
    """The slots that exist (``len``), of at most ``capacity``, over ``backing``'s memory of
    ``stride`` bytes a slot (NOTE [ A pool as large as what is in flight ])."""

    def __init__(
        self,
        slots: int,
        capacity: int = 0,
        backing: Backing | None = None,
        stride: int = 0,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
        ahead: int = 0,
    ) -> None:
        """``ahead``: the bytes of a slot reserved when it is added (0: all ``stride``); the rest
        is its room for encoded rows, reserved when a batch there first leaves a row encoded
        (``room``; NOTE [ Encoded rows ] in protocol/encoded.py), so a pool whose trainers decode
        nothing never holds it."""
        self.capacity = max(capacity, slots)
        self.first = slots
        """The size it started at: it never gives back below it."""
        self._states = [SlotState.FREE] * slots
        self._free = list(range(slots))
        """A heap: the lowest free slot first."""
        self._ready_since: dict[int, float] = {}
        self._backing: Backing = backing or _Unbacked()
        self._stride = stride
        self._ahead = ahead or stride
        self._roomy: set[int] = set()
        """Slots whose room for encoded rows is reserved too."""
        self.room_refused = 0
        """Batches decoded whole because /dev/shm had no room for their slot's encoded rows."""
        self._name = name
        self.refused = 0
        """Growths refused: /dev/shm full, or at its floor (NOTE [ A /dev/shm floor ])."""
        self.given_back = 0
        """Slots given back (NOTE [ Giving slots back ])."""
        self._clock = clock
        self._retry_at = float("-inf")
        self._peak = 0
        self._looked_at = clock()
        self._refusals = LogLimiter("refused pool growths", per_minute=1)

    def __len__(self) -> int:
        return len(self._states)

    @property
    def full(self) -> bool:
        """Whether the pool has every slot it may have."""
        return len(self._states) >= self.capacity

    @property
    def in_use(self) -> int:
        return len(self._states) - len(self._free)

    def add(self) -> None:
        """One more FREE slot, the next one, whose memory the caller has reserved."""
        if self.full:
            raise SlotStateError(f"the pool already has its {self.capacity} slots")
        self._states.append(SlotState.FREE)
        heapq.heappush(self._free, len(self._states) - 1)

    def grow(self) -> bool:
        """One more slot, its memory reserved; False at the capacity, or where /dev/shm cannot
        hold it above its floor (NOTE [ A pool as large as what is in flight ])."""
        now = self._clock()
        if self.full or now < self._retry_at:
            return False
        if not self._backing.reserve(len(self) * self._stride, self._ahead):
            self.refused += 1
            self._retry_at = now + GROW_RETRY
            if self._refusals.allow(now):
                log.warning(
                    "feed %s: pool not grown past %d slots: /dev/shm has no room for %.1f MiB more "
                    "above its floor (NOTE [ A /dev/shm floor ]); trainers share the slots there are",
                    self._name,
                    len(self),
                    self._stride / 2**20,
                )
            return False
        self.add()
        return True

    def give_back(self, now: float, keep: int, after: float) -> int:
        """The top free slots, if the pool has been mostly free for ``after`` seconds; never one of
        the first ``keep`` (NOTE [ Giving slots back ]). Returns how many."""
        if now - self._looked_at < after:
            return 0
        peak, self._peak, self._looked_at = self._peak, self.in_use, now
        size = end = len(self._states)
        if 2 * peak > size:
            return 0
        lowest = max(self.first, 2 * peak, keep)
        while end > lowest and self._states[end - 1] is SlotState.FREE:
            end -= 1
        if end == size:
            return 0
        del self._states[end:]
        self._roomy = {slot for slot in self._roomy if slot < end}
        self._free = [slot for slot in self._free if slot < end]
        heapq.heapify(self._free)
        self._backing.give_back(end * self._stride, (size - end) * self._stride)
        self.given_back += size - end
        log.info(
            "feed %s: pool gave back %d slots (%.1f MiB), %d left: at most %d were in use at once "
            "for %.0f s (NOTE [ Giving slots back ])",
            self._name,
            size - end,
            (size - end) * self._stride / 2**20,
            end,
            peak,
            after,
        )
        return size - end

    def room(self, slot: int) -> bool:
        """Whether ``slot``'s room for encoded rows is reserved, reserving it now if it may be: a
        worker writes there only after this said True (every byte reserved before it is used)."""
        if self._ahead >= self._stride or slot in self._roomy:
            return True
        start = slot * self._stride + self._ahead
        if not self._backing.reserve(start, self._stride - self._ahead):
            self.room_refused += 1
            return False
        self._roomy.add(slot)
        return True

    @property
    def free(self) -> int:
        """Slots ``acquire`` can hand out now."""
        return len(self._free)

    def state(self, slot: int) -> SlotState:
        return self._states[slot]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in SlotState}
        for s in self._states:
            out[s.value] += 1
        return out

    def acquire(self) -> int | None:
        """FREE -> FILLING, the lowest free slot; None when every slot is in use."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._move(slot, SlotState.FREE, SlotState.FILLING)
        self._peak = max(self._peak, self.in_use)
        return slot

    def filled(self, slot: int) -> None:
        self._move(slot, SlotState.FILLING, SlotState.READY)
        self._ready_since[slot] = self._clock()

    def lease(self, slot: int) -> float:
        """READY -> LEASED; return the seconds the batch waited ready for a trainer."""
        self._move(slot, SlotState.READY, SlotState.LEASED)
        now = self._clock()
        return now - self._ready_since.pop(slot, now)

    def release(self, slot: int) -> None:
        """LEASED, READY or (after its task reported) FILLING -> FREE."""
        if self._states[slot] is SlotState.FREE:
            raise SlotStateError(f"slot {slot} released twice")
        self._states[slot] = SlotState.FREE
        heapq.heappush(self._free, slot)

    def _move(self, slot: int, expected: SlotState, new: SlotState) -> None:
        if self._states[slot] is not expected:
            raise SlotStateError(f"slot {slot} is {self._states[slot].value}, expected {expected.value}")
        self._states[slot] = new
