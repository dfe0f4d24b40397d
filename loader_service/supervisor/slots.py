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
    trainer's batch finds no free slot, the pool grows by one reserved slot, up to the capacity;
    it never shrinks while the service runs. So:
    * slots ``0 .. len(pool) - 1`` are backed by memory, and no other slot is ever handed out: a
      worker or a trainer never touches a page that is not reserved (no SIGBUS on a full /dev/shm);
    * a trainer that sees slot ``s`` may take every slot below it as backed (it pins them for CUDA);
    * a /dev/shm too small for one more slot stops the growth, with one warning: trainers then share
      the slots there are, as they shared a fixed pool.
"""

from __future__ import annotations

import enum
import time


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    READY = "ready"
    LEASED = "leased"


class SlotStateError(RuntimeError):
    """A transition that NOTE [ Slot lifecycle ] forbids; always a bug in the service."""


class SlotPool:
    """The slots that exist (``len``), of at most ``capacity`` (NOTE [ A pool as large as what is in
    flight ])."""

    def __init__(self, slots: int, capacity: int = 0) -> None:
        self.capacity = max(capacity, slots)
        self._states = [SlotState.FREE] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._ready_since: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._states)

    @property
    def full(self) -> bool:
        """Whether the pool has every slot it may have."""
        return len(self._states) >= self.capacity

    def add(self) -> None:
        """One more FREE slot, the next one, whose memory the caller has reserved."""
        if self.full:
            raise SlotStateError(f"the pool already has its {self.capacity} slots")
        self._states.append(SlotState.FREE)
        self._free.append(len(self._states) - 1)

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
        """FREE -> FILLING; None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._move(slot, SlotState.FREE, SlotState.FILLING)
        return slot

    def filled(self, slot: int) -> None:
        self._move(slot, SlotState.FILLING, SlotState.READY)
        self._ready_since[slot] = time.monotonic()

    def lease(self, slot: int) -> float:
        """READY -> LEASED; return the seconds the batch waited ready for a trainer."""
        self._move(slot, SlotState.READY, SlotState.LEASED)
        return time.monotonic() - self._ready_since.pop(slot, time.monotonic())

    def release(self, slot: int) -> None:
        """LEASED, READY or (after its task reported) FILLING -> FREE."""
        if self._states[slot] is SlotState.FREE:
            raise SlotStateError(f"slot {slot} released twice")
        self._states[slot] = SlotState.FREE
        self._free.append(slot)

    def _move(self, slot: int, expected: SlotState, new: SlotState) -> None:
        if self._states[slot] is not expected:
            raise SlotStateError(f"slot {slot} is {self._states[slot].value}, expected {expected.value}")
        self._states[slot] = new
