"""Encoded rows: a batch row that carries an image's compressed bytes and what the service decided
for it, for the trainer to decode (``ServiceLoader(decode=...)``). Pure: the table's format and its
checks; ``protocol.pixels.render`` turns a row into pixels.

NOTE [ Encoded rows ]
    A feed that offers them (``FeedInfo.encoded``: bytes of room per row, 0 for none) has two more
    areas in every slot after the indices (``protocol.layout``): a table of ``COLUMNS`` int64 per
    row and ``capacity * encoded`` bytes. Row ``r`` of a batch is encoded when ``table[r, LENGTH]``
    is above 0: its image field holds nothing yet, and the JPEG's bytes are at ``table[r, OFFSET]``
    in the byte area. The rest of the row says what the service's own decode would have done with
    them: the mode (a train crop, or eval's centre), the region decoded and its DCT scale, the
    flip, the filter, and the image's height and width as its header says. The crop and flip are
    the seeded draws the service makes for a decoded row (``sample_rng``), so a replay, a resume or
    another world size gives the same row whichever side decodes it, and ``protocol.pixels.render`` is the
    one function both sides run to make the pixels. A row the service decoded has a zero row here.
    A task writes its encoded bytes only inside the byte range of the rows it was given
    (``[row * encoded, (row + rows) * encoded)``), so the parts of a split batch never share bytes,
    and a row moved down by compaction takes its table row along (its offset stays valid).
    Nothing of a table row is trusted by a trainer: ``EncodedRow.check`` bounds every column
    against the area and the image it names, and the trainer reads the header again itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

COLUMNS: Final = 12
"""int64 columns of a table row (some spare, so a new one needs no new layout)."""
OFFSET, LENGTH, MODE, FLAGS, HEIGHT, WIDTH, TOP, LEFT, CROP_HEIGHT, CROP_WIDTH, SCALE, FILTER = range(12)
TRAIN: Final = 1
"""RandomResizedCrop's crop (``TOP`` .. ``CROP_WIDTH``), resized to the output, then the flip."""
EVAL: Final = 2
"""Shorter side to ``round(S * 256 / 224)``, centre ``S x S``; the columns name the region decoded."""
MODES: Final = (TRAIN, EVAL)
FLIP: Final = 1
"""``FLAGS`` bit: mirror the row."""
SCALES: Final = (1, 2, 4, 8)
"""DCT scales in eighths the region decoder may use."""
FILTERS: Final = ("bilinear-antialias", "bilinear", "area")
"""The resize filters by number (``--interpolation``'s choices, in its order)."""
MAX_PIXELS: Final = 1 << 30
"""No image a row names may be larger, whatever the service's own limit."""
MAX_SHARE: Final = 1000
"""A share of a batch's rows to send encoded, in thousandths (``Hello.encode``, ``Heartbeat.encode``)."""


class BadRow(ValueError):
    """A table row that does not describe a row this trainer can decode safely."""


@dataclass(frozen=True)
class EncodedRow:
    """One encoded row, as the table holds it."""

    offset: int
    length: int
    mode: int
    flip: bool
    height: int
    width: int
    top: int
    left: int
    crop_height: int
    crop_width: int
    scale: int
    filter: str

    def columns(self) -> tuple[int, ...]:
        """The row's ``COLUMNS`` table entries."""
        cols = [0] * COLUMNS
        cols[OFFSET], cols[LENGTH], cols[MODE] = self.offset, self.length, self.mode
        cols[FLAGS] = FLIP if self.flip else 0
        cols[HEIGHT], cols[WIDTH] = self.height, self.width
        cols[TOP], cols[LEFT], cols[CROP_HEIGHT], cols[CROP_WIDTH] = (
            self.top,
            self.left,
            self.crop_height,
            self.crop_width,
        )
        cols[SCALE], cols[FILTER] = self.scale, FILTERS.index(self.filter)
        return tuple(cols)

    @classmethod
    def check(cls, cols: tuple[int, ...] | list[int], area: int, max_pixels: int = MAX_PIXELS) -> EncodedRow:
        """The row ``cols`` describes, each column bounded (the bytes inside an ``area``-byte area,
        an image of at most ``max_pixels``, the region inside it, a known mode, scale and filter);
        BadRow naming the first that is not."""
        if len(cols) != COLUMNS:
            raise BadRow(f"a table row has {len(cols)} columns, not {COLUMNS}")
        offset, length = int(cols[OFFSET]), int(cols[LENGTH])
        if not (offset >= 0 and length > 0 and offset + length <= area):
            raise BadRow(f"bytes [{offset}, {offset + length}) are outside the {area}-byte area")
        mode, flags, scale, number = (int(cols[i]) for i in (MODE, FLAGS, SCALE, FILTER))
        if mode not in MODES or flags & ~FLIP or scale not in SCALES or not 0 <= number < len(FILTERS):
            raise BadRow(f"mode {mode}, flags {flags}, scale {scale}, filter {number}: not a known one")
        height, width = int(cols[HEIGHT]), int(cols[WIDTH])
        if not (height > 0 and width > 0 and height * width <= MAX_PIXELS):
            raise BadRow(f"an image of {height} x {width} pixels")
        top, left, crop_h, crop_w = (int(cols[i]) for i in (TOP, LEFT, CROP_HEIGHT, CROP_WIDTH))
        if not (top >= 0 and left >= 0 and crop_h > 0 and crop_w > 0):
            raise BadRow(f"a region at ({top}, {left}) of {crop_h} x {crop_w}")
        if top + crop_h > height or left + crop_w > width:
            raise BadRow(f"a region at ({top}, {left}) of {crop_h} x {crop_w} outside {height} x {width}")
        return cls(
            offset, length, mode, bool(flags & FLIP), height, width, top, left, crop_h, crop_w, scale,
            FILTERS[number],
        )  # fmt: skip


def bytes_named(offsets: Sequence[int], lengths: Sequence[int], area: int) -> int:
    """Where the last byte a batch's table names ends (rows whose length is 0 name none), at most
    ``area``: how much of the byte area a remote trainer is sent, or a device decode copies."""
    return max(0, min(max((o + n for o, n in zip(offsets, lengths, strict=True) if n > 0), default=0), area))


def encoded_rows(share: int, rows: int) -> list[bool]:
    """Which of ``rows`` samples to send encoded for a share of ``share`` thousandths: spread over
    the rows (not the first ones), the same answer for the same numbers."""
    share = max(0, min(MAX_SHARE, share))
    return [(j + 1) * share // MAX_SHARE > j * share // MAX_SHARE for j in range(rows)]
