"""Moving delivered batches to the training device.

CPU: nothing moves; the trainer gets zero-copy views of shared memory.

CUDA (chosen at run time, never on a CPU-only machine; tests/gpu runs it where a GPU is visible):
    * the slots are pinned with ``cudaHostRegister`` as the pool grows (each range once, up to the
      highest slot announced: NOTE [ A pool as large as what is in flight ] in
      loader_service/supervisor/slots.py), so copies from them are true asynchronous DMA; every
      range is unregistered before the segment is unmapped. Both calls are
      checked (``check_cudart``); a failed registration only costs speed (pageable copies), as long
      as CUDA's last error could be cleared (torch's binding, or the runtime torch loaded, through
      ctypes), and is an error otherwise;
    * every field of each batch is copied with ``non_blocking=True`` on a side stream; the trainer's
      current stream waits on an event, so the copy overlaps the previous step's kernels and the next
      step cannot read a field early (the indices stay on the CPU);
    * the host batch (and so its slot lease) is kept until that event has completed, then dropped,
      which releases the slot (NOTE [ Slot lifecycle ] in loader_service/supervisor/slots.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the range counts as pinned in every CUDA context of the process, not
only the current device's; torch's own pin helper registers with it too."""


class CudaCallError(RuntimeError):
    """A CUDA runtime call failed. ``cleared``: whether CUDA's last error was reset afterwards."""

    def __init__(self, message: str, cleared: bool) -> None:
        super().__init__(message)
        self.cleared = cleared


def check_cudart(cudart: Any, err: Any, call: str) -> None:
    """Raise ``CudaCallError`` naming ``err``, the result of ``call`` through ``cudart``, unless success.

    A failed runtime call also leaves the thread's last error set, and torch checks that after its
    next kernel launch: an unrelated operation would fail later with this error. So it is consumed
    here, where it happened (``last_error_clearer``); where nothing can clear it the error stays set,
    and the exception says so.
    """
    code = int(err)
    if code == 0:
        return
    clear = last_error_clearer(cudart)
    if clear is not None:
        clear()
    # The binding takes its own enum type, not an int: name the value the call returned.
    message = f"{call} failed: {cudart.cudaGetErrorString(err)} (cudaError {code})"
    if clear is None:
        message += "; CUDA's last error is still set (this torch binds no cudaGetLastError)"
    raise CudaCallError(message, cleared=clear is not None)


def last_error_clearer(cudart: Any) -> Callable[[], object] | None:
    """What resets this thread's CUDA last error: torch's binding, else the loaded runtime's own symbol.

    Only torch releases from 2.12 on bind cudaGetLastError in ``torch.cuda.cudart()`` (2.11, seen on
    an H100, does not). Their wheels load the runtime as a shared library, so the same function
    (and the same per-thread error) is reachable through ctypes.
    """
    bound = getattr(cudart, "cudaGetLastError", None)
    if bound is not None:
        return bound  # type: ignore[no-any-return]
    return loaded_library_function("libcudart.so", "cudaGetLastError")


def loaded_library_function(prefix: str, name: str) -> Callable[[], int] | None:
    """``name()`` from a library this process has already mapped whose file name starts with ``prefix``.

    RTLD_NOLOAD: a library that is not loaded yet is never loaded here, so this cannot bring in a
    second CUDA runtime with an error state of its own.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {fields[5] for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
    except OSError:
        return None
    for path in sorted(p.strip() for p in paths if os.path.basename(p.strip()).startswith(prefix)):
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        function = getattr(library, name, None)
        if function is not None:
            function.argtypes, function.restype = [], ctypes.c_int
            return function  # type: ignore[no-any-return]
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}: use cpu, cuda[:N] or auto")
    return device


class CudaStager:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._in_flight: deque[tuple[torch.cuda.Event, Any]] = deque()
        self._pinned: list[int] = []

    def pin(self, address: int, nbytes: int) -> None:
        """Register one more range of the mapped pool; a failure only costs speed (pageable copies)."""
        try:
            with torch.cuda.device(self.device):  # not a context on GPU 0 for every rank
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE)
                check_cudart(cudart, err, "cudaHostRegister")
        except CudaCallError as exc:
            if not exc.cleared:
                raise  # going on would let the next kernel launch fail with this error
            log.warning("%s; copies will not overlap compute", exc)
            return
        self._pinned.append(address)

    def stage(self, tensors: Sequence[torch.Tensor], keep_alive: object) -> list[torch.Tensor]:
        """Start copying every tensor; return device tensors the current stream may use in order.

        ``keep_alive`` (the host batch, and so its slot lease) is held until all the copies are done.
        """
        self.collect()
        with torch.cuda.stream(self._stream):
            on_device = [t.to(self.device, non_blocking=True) for t in tensors]
            done = torch.cuda.Event()
            done.record(self._stream)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in on_device:
            # Allocated on the side stream, used on the current one: tell the caching allocator.
            t.record_stream(current)
        self._in_flight.append((done, keep_alive))
        return on_device

    def collect(self) -> None:
        """Drop host batches whose copies have completed, releasing their slots."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()

    def unpin(self) -> None:
        """Unregister every range, once the copies from them are finished: before a reconnect's new
        pool replaces the old one, whose mapping may then go away."""
        if not self._pinned:
            return
        pinned, self._pinned = self._pinned, []  # a failed unregister is not tried again
        self._stream.synchronize()
        self._in_flight.clear()
        with torch.cuda.device(self.device):
            cudart = torch.cuda.cudart()
            for address in pinned:
                check_cudart(cudart, cudart.cudaHostUnregister(address), "cudaHostUnregister")

    def close(self) -> None:
        self._stream.synchronize()
        self._in_flight.clear()
        self.unpin()
