"""Encoded rows decoded in the trainer's process (``ServiceLoader(decode=...)``): a batch's encoded rows
(NOTE [ Encoded rows ] in protocol/encoded.py) go to a small pool of threads as soon as the batch
arrives, each row made by ``protocol.pixels.render`` (the service's own code, so the same pixels), written
into the batch's image rows before the loop is handed it.

A row whose table entry or bytes do not make a row (a JPEG whose header passes and whose data does
not decode) costs that row: it is left out of its batch, and the service is told (``Spoiled``),
which logs and counts it like a bad file. Nothing from the table is used before ``EncodedRow.check``
has bounded it. The pool's threads spend their time in C code that lets go of the GIL (libjpeg-turbo,
the resampler, OpenCV), so the loop's own thread runs beside them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from gpu_worker.loader_config import DECODES, MAX_DECODE_THREADS
from gpu_worker.loop_clock import LoopClock
from gpu_worker.split import WINDOW, Split, Window
from protocol.encoded import LENGTH, MAX_PIXELS, MAX_SHARE, BadRow, EncodedRow
from protocol.pixels import DecodeError

Bad = list[tuple[int, str]]
"""(row, why) of rows that could not be decoded."""


@dataclass
class Pending:
    """One batch's encoded rows being decoded."""

    futures: list[Future[Bad]]
    image: npt.NDArray[np.uint8]
    """The rows being written: the slot's own (shm), or a writable copy of the received ones (tcp)."""
    keep: Any = None
    """What keeps the memory written into alive until the decode is over (the slot's buffer)."""
    rows: int = 0


@dataclass
class DecodeCounts:
    rows: int = 0
    """Rows this process decoded."""
    spoiled: int = 0
    """Rows it could not decode (left out, reported)."""
    seconds: float = 0.0
    """Thread seconds spent decoding."""
    batches: int = 0
    """Batches handed to the loop (with any encoded row or not)."""
    delivered: int = 0
    """Rows handed to the loop, whoever decoded them."""
    history: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the loader began, share) each time the split moved; the last 64."""


class RowDecoder:
    """One per loader: its threads, its split and its counts, shared by every service's delivery."""

    def __init__(self, mode: str, threads: int, clock: LoopClock) -> None:
        if mode not in DECODES:
            raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {mode!r}")
        if not 1 <= threads <= MAX_DECODE_THREADS:
            raise ValueError(f"decode_threads must be 1 to {MAX_DECODE_THREADS}, got {threads}")
        self.mode = mode
        self.threads = threads
        self.unable = ""
        """Why this process cannot decode encoded rows though asked to ('' where it can)."""
        self.split = Split(MAX_SHARE if mode == "trainer" else 0, fixed=mode != "auto")
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None
        if mode != "service":
            from protocol.pixels import regions
            from protocol.pixels.render import render  # OpenCV: imported only by a loader that decodes

            self._render = render
            if regions.built():
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dataferry-decode")
            else:
                self.unable = (
                    "the region decoder (protocol.pixels._jpegcrop) is not built in this install: install "
                    "libjpeg-turbo's headers (Debian: libjpeg-dev) and reinstall dataferry"
                )
        self._lock = threading.Lock()
        self.counts = DecodeCounts()
        self._began = time.monotonic()
        self._window = (self._began, 0.0, 0.0, 0, 0.0, 0)
        """(start, waited, computed, rows delivered, decode seconds, rows decoded) when it began."""

    @property
    def takes_encoded(self) -> bool:
        return self._pool is not None

    @property
    def share(self) -> int:
        """Thousandths of its rows the loader asks to decode itself now (-1: it never does)."""
        return self.split.share if self.takes_encoded else -1

    # --- one batch ------------------------------------------------------------------------------

    def start(
        self,
        table: npt.NDArray[np.int64],
        area: npt.NDArray[np.uint8],
        image: npt.NDArray[np.uint8],
        keep: Any,
        max_pixels: int = MAX_PIXELS,
    ) -> Pending | None:
        """Begin decoding the encoded rows ``table`` names (``[count, COLUMNS]``, a copy) from the
        byte ``area`` into ``image`` (``[count, 3, S, S]``), none of an image over ``max_pixels``
        (the service's limit); None where it names none."""
        if self._pool is None:
            return None
        rows = np.flatnonzero(table[:, LENGTH] != 0)
        if not len(rows):
            return None
        chunks = np.array_split(rows, min(self.threads, len(rows)))
        futures = [self._pool.submit(self._decode, table, area, image, chunk, max_pixels) for chunk in chunks]
        return Pending(futures, image, keep, len(rows))

    def _decode(
        self,
        table: npt.NDArray[np.int64],
        area: npt.NDArray[np.uint8],
        image: npt.NDArray[np.uint8],
        rows: npt.NDArray[np.intp],
        max_pixels: int,
    ) -> Bad:
        bad: Bad = []
        for r in rows.tolist():
            began = time.perf_counter()
            why = ""
            try:
                row = EncodedRow.check(table[r].tolist(), len(area), max_pixels)
                self._render(area[row.offset : row.offset + row.length].tobytes(), row, image[r])
            except (BadRow, DecodeError) as exc:
                why = str(exc)[:200]
            except Exception as exc:  # an OpenCV failure on one row must not take the loop down
                why = f"{type(exc).__name__}: {exc}"[:200]
            if why:
                bad.append((r, why))
            with self._lock:  # each row as it is done: the split reads a busy share from this
                self.counts.seconds += time.perf_counter() - began
                self.counts.rows += not why
                self.counts.spoiled += bool(why)
        return bad

    def counted(self, made: int, spoiled: int, seconds: float) -> None:
        """Rows decoded elsewhere than this pool's threads (the GPU's engine), for the counts."""
        with self._lock:
            self.counts.rows += made
            self.counts.spoiled += spoiled
            self.counts.seconds += seconds

    def finish(self, pending: Pending, timeout: float) -> Bad:
        """Wait for the batch's rows (TimeoutError after ``timeout`` seconds); the bad ones."""
        deadline = time.monotonic() + timeout
        bad: Bad = []
        for future in pending.futures:
            bad += future.result(max(0.0, deadline - time.monotonic()))
        return bad

    def abandon(self, pending: Pending) -> None:
        """A batch the loop will not see: its rows not yet begun are not decoded, and those begun are
        waited for, so nothing writes into its slot once it is given back. That wait has no timeout
        of its own: a row's decode is bounded by its image (at most the service's pixel limit)."""
        for future in pending.futures:
            future.cancel()
        for future in pending.futures:
            if not future.cancelled():
                try:
                    future.result()
                except Exception:
                    pass

    # --- the split ------------------------------------------------------------------------------

    def handed(self, rows: int) -> None:
        """The loop was handed a batch of ``rows`` rows; once a window has passed, the split looks."""
        counts = self.counts
        counts.batches += 1
        counts.delivered += rows
        now = time.monotonic()
        start, waited0, computed0, rows0, seconds0, decoded0 = self._window
        if now - start < WINDOW or self.split.fixed:
            return
        waited, computed = self._clock.totals()
        with self._lock:
            seconds, decoded = counts.seconds, counts.rows + counts.spoiled
        busy = (seconds - seconds0) / ((now - start) * self.threads)
        delivered = counts.delivered - rows0
        realized = (decoded - decoded0) / delivered if delivered else 0.0
        window = Window(now - start, waited - waited0, computed - computed0, delivered, min(1.0, busy))
        window = replace(window, realized=min(1.0, realized))
        before = self.split.share
        share = self.split.observe(window)
        if share != before:
            counts.history = [*counts.history[-63:], (round(now - self._began, 3), share)]
        self._window = (now, waited, computed, counts.delivered, seconds, decoded)

    def stats(self) -> dict[str, object]:
        """``loader.stats()["decode"]``."""
        c = self.counts
        with self._lock:
            rows, seconds, spoiled = c.rows, c.seconds, c.spoiled
        return {
            "mode": self.mode,
            "threads": self.threads if self.takes_encoded else 0,
            "share": round(max(0, self.share) / MAX_SHARE, 3),
            "trainer_rows": rows,
            "service_rows": max(0, c.delivered - rows),
            "spoiled": spoiled,
            "trainer_ms_per_image": round(1000 * seconds / rows, 3) if rows else None,
            "moves": self.split.moves,
            "history": [list(h) for h in c.history[-8:]],
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
