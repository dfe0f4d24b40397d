"""Where each trainer stands in each source of its feed (issue 38): samples served, the share asked
and the share realized, and, for a weighted job, the pass over each source and the position in it.

NOTE [ Source ledger ]
    A batch's rows are counted by source when it is announced to a trainer, from the sample numbers
    its worker wrote into the slot (NOTE [ Sources of a feed ]: a source's samples follow the ones
    before it), so bad samples a batch left out are not counted; a sample number outside the feed
    (a slot a peer could scribble on) counts for the nearest source, never outside the table. Per
    trainer (``status``' sessions) and per feed (the metrics' counter). A weighted job's pass and
    position in each source are read at its stream's planning front: where the whole job's next
    planned batch begins in the epoch's order (its ranks move in step), walked from the epoch's
    nearest mark (NOTE [ Epoch marks ]): at most a stride of positions a job, wherever in its
    epoch it is, so a status costs O(sessions), never a count from position 0 on the main loop
    (that cost 0.1 to 0.35 s a job whose epoch had changed: 0.63 s a status with 8 peers).
    For a feed of one source nothing is counted.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from loader_service.dataset.mixture import Mixture
from loader_service.supervisor.feeds import Feed
from loader_service.supervisor.streams.stream import Stream
from protocol.status import SessionSource
from protocol.weights import WEIGHT_UNIT

Counts = npt.NDArray[np.int64]


def batch_sources(feed: Feed, slot: int, count: int) -> Counts | None:
    """Each source's rows among a decoded batch's ``count``; None for a feed of one source."""
    offsets = feed.sources.offsets
    sources = len(offsets) - 1
    if sources < 2:
        return None
    numbers = feed.slot_indices(slot, count)
    source = np.clip(np.searchsorted(offsets, numbers, side="right") - 1, 0, sources - 1)
    counts: Counts = np.bincount(source, minlength=sources)
    return counts


def count_served(feed: Feed, served: Counts | None, slot: int, count: int) -> Counts | None:
    """Add a batch announced to a trainer to what it was served by source (``served``, None before
    its first) and to the feed's; returns the trainer's new counts (NOTE [ Source ledger ])."""
    counts = batch_sources(feed, slot, count)
    if counts is None:
        return None
    feed.counters.served_by_source = counts + (
        0 if feed.counters.served_by_source is None else feed.counters.served_by_source
    )
    return counts if served is None else served + counts


def _asked(mixture: Mixture | None, feed: Feed, epoch: int, position: int) -> list[float]:
    """The shares the job asks for at ``position`` of ``epoch``: its weights in force there, or each
    source's size for a job without weights."""
    if mixture is None:
        sizes = [len(index) for index in feed.sources.indexes]
        return [size / sum(sizes) for size in sizes]
    at = epoch * mixture.epoch_samples + position
    weights = next(w for p, w in reversed(mixture.weighting.changes) if p <= at)
    return [w / WEIGHT_UNIT for w in weights]


def source_status(feed: Feed, stream: Stream | None, served: Counts | None) -> tuple[SessionSource, ...]:
    """Per source, what ``status`` shows of one trainer (NOTE [ Source ledger ]); none for a feed of
    one source."""
    if served is None or stream is None:
        return ()
    mixture = stream.mixture
    position, drawn = stream.front()
    asked = _asked(mixture, feed, stream.epoch, position)
    total = int(served.sum())
    rows: list[SessionSource] = []
    for s, name in enumerate(feed.sources.names):
        passes = at = None  # a job without weights has no passes
        if drawn is not None and mixture is not None:
            passes, at = divmod(int(drawn[s]), mixture.sizes[s])
        rows.append(
            SessionSource(
                source=name,
                served=int(served[s]),
                share=round(int(served[s]) / total, 4) if total else 0.0,
                asked=round(asked[s], 4),
                passes=passes,
                position=at,
            )
        )
    return tuple(rows)
