"""Mapping the service's slot pool into a trainer process.

The segment is mapped shared and writable: a trainer that writes into a delivered batch in place only
changes a slot it holds (the service never reads it back and rewrites it after release). A read-only
mapping would turn such a write into a segmentation fault inside torch instead of a Python error.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import numpy.typing as npt

from gpu_worker.peer import check_segment
from protocol.layout import SlotLayout, validate_segment_name

SHM_DIR = "/dev/shm"


class SlotMap:
    """The whole pool as one uint8 array, and fresh per-delivery views of single slots."""

    def __init__(
        self, segment: str, layout: SlotLayout, slots: int, check: str = "", owner: int | None = None
    ) -> None:
        """Map the pool; with ``check`` (the hex the service announced), prove it is that service's
        pool by the bytes after it (``protocol.layout``), or raise ValueError. The segment must be
        the service's, owned by ``owner`` (NOTE [ A service's identity ] in gpu_worker/peer.py)."""
        self.layout = layout
        self.slots = slots
        self.nbytes = layout.segment_bytes(slots)
        expected = bytes.fromhex(check)
        size = layout.mapped_bytes(slots) if expected else self.nbytes
        fd = os.open(os.path.join(SHM_DIR, validate_segment_name(segment)), os.O_RDWR | os.O_NOFOLLOW)
        try:
            check_segment(fd, segment, owner)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"segment {segment} is smaller than the {size} bytes its pool needs")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self._mmap[self.nbytes : self.nbytes + len(expected)] != expected:
            self._mmap.close()
            raise ValueError(f"segment {segment} is not the announced pool (its check bytes differ)")
        self.base: npt.NDArray[np.uint8] | None = np.frombuffer(self._mmap, dtype=np.uint8, count=self.nbytes)

    @property
    def address(self) -> int:
        assert self.base is not None
        return int(self.base.ctypes.data)

    def slot(self, slot: int) -> ctypes.Array[ctypes.c_uint8]:
        """A new buffer object over one slot's bytes, to be the root of every view of that batch.

        numpy collapses view chains to the array that owns the memory, so a numpy slice of ``base``
        would not stay alive as long as its views do; a ctypes array does (arrays made from it with
        ``np.frombuffer`` keep it as their base), so its lifetime is exactly the lease's lifetime.
        """
        start = self.layout.slot_offset(slot, self.slots)  # raises for a slot outside the pool
        return (ctypes.c_uint8 * self.layout.stride).from_buffer(self._mmap, start)

    def close(self) -> None:
        """Unmap now if no batch view is alive; otherwise the mapping goes with the last view."""
        self.base = None
        try:
            self._mmap.close()
        except BufferError:
            pass
