"""The region decoder (``_jpegcrop.c``): decode only the part of a JPEG a crop needs, at 1/2, 1/4 or 1/8
scale when it is large (``roi_scale``), and what decides which files it may take.

Unscaled, its pixels are OpenCV's exactly; scaled, libjpeg-turbo's DCT scaling replaces the first
halvings of the resize, which changes pixels slightly but not their statistics. Anything it does not
handle (other formats, CMYK, EXIF rotation, a file not ending in an EOI marker, a decoder error) is
left to the full OpenCV decode (``transforms``), which rejects the same files.

NOTE [ Eval regions ]
    Eval resizes the whole image (shorter side to ``round(S * 256 / 224)``) and keeps the centre
    ``S x S``, as torchvision does. Each output pixel of that centre depends only on the source
    pixels under its filter's support, so the region decoder decodes just the centre region plus
    a margin wider than any filter's support (``eval_region``) into an image-sized canvas whose
    other pixels are never written, and the usual resize-then-crop runs on that canvas. The
    centre's pixels are then exactly the full decode's (tested); the rest of the canvas, whatever
    it holds, never reaches the output. With ``bilinear-antialias`` only the centre window of the
    resize is computed (``_resample.c``), exactly as the whole resize would have it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from protocol.pixels.geometry import U8, Crop, eval_geometry

_jpegcrop: ModuleType | None
try:
    from protocol.pixels import _jpegcrop
except ImportError:  # built only where libjpeg-turbo's headers were found at install time
    _jpegcrop = None

_JPEG_START = b"\xff\xd8\xff"  # what OpenCV requires; libjpeg alone would skip stray bytes
# OpenCV refuses a JPEG that ends before its EOI marker, while the region decoder may never read that
# far; such files (and files with bytes after EOI) go to OpenCV, so both paths reject the same files.
_JPEG_END = b"\xff\xd9"


def built() -> bool:
    """Whether the region decoder was built on this install."""
    return _jpegcrop is not None


def eval_region(height: int, width: int, size: int, num: int = 8) -> Crop:
    """The source pixels eval's centre crop depends on, whatever the filter (NOTE [ Eval regions ]):
    the crop mapped back to the image, widened by the filter's support (at most the scale factor,
    rounded up) plus two pixels, clipped to the image. ``num``: the region will be decoded at
    ``num``/8 scale, so the margin is counted in scaled pixels."""
    new_h, new_w, c = eval_geometry(height, width, size)
    top, bottom = _support(c.top, c.top + size, height / new_h, height, num)
    left, right = _support(c.left, c.left + size, width / new_w, width, num)
    return Crop(top, left, bottom - top, right - left)


def _support(start: int, stop: int, scale: float, limit: int, num: int) -> tuple[int, int]:
    margin = (math.ceil(max(scale * num / 8, 1.0)) + 2) * 8 // num
    return max(0, math.floor(start * scale) - margin), min(limit, math.ceil(stop * scale) + margin)


def whole_jpeg(data: bytes) -> bool:
    return data.startswith(_JPEG_START) and data.endswith(_JPEG_END)


def roi_header(data: bytes) -> tuple[int, int] | None:
    """(height, width) if the region decoder can produce exactly what OpenCV would, else None."""
    assert _jpegcrop is not None
    try:
        height, width, orientation, usable = _jpegcrop.header(data)
    except ValueError:
        return None  # OpenCV gives the error its own words, or decodes what libjpeg refused
    if not usable or orientation != 1 or height * width > _max_pixels():
        return None
    return int(height), int(width)


def _max_pixels() -> int:
    """OpenCV's pixel limit (the service sets it from ``max_pixels``); images above it go to OpenCV,
    which refuses them with the message the bad-file report expects."""
    try:
        return int(os.environ.get("OPENCV_IO_MAX_IMAGE_PIXELS", str(1 << 30)))
    except ValueError:
        return 0


ROI_HEADROOM = {"bilinear-antialias": 2.0, "bilinear": math.inf, "area": 3.0}
"""Per filter, how many times the output size a DCT-scaled region must stay on both sides, so the
resize after it still does most of the shrinking: the smallest headroom (of 1, 1.5, 2, 3, 4, 6)
whose outputs kept their sharpness (mean absolute horizontal gradient) within
``SHARPNESS_TOLERANCE`` of a full decode's with the same filter, on every set that
``python -m benchmarks.dct_scaling`` measured (docs/benchmarks/log.md). Plain ``bilinear`` never
scales: its full-decode output is sharp because it aliases (it samples a few source pixels per
output pixel), which a DCT-scaled decode, an averaging, cannot reproduce at any headroom measured
(0.95 at 4x)."""
SHARPNESS_TOLERANCE = 0.03


def roi_scale(crop: Crop, size: int, headroom: float = ROI_HEADROOM["area"]) -> int:
    """libjpeg-turbo's scale in eighths: the smallest of 8/8, 4/8, 2/8, 1/8 that keeps the crop
    at least ``headroom * size`` on both sides."""
    num = 8
    while num > 1 and min(crop.height, crop.width) * (num // 2) >= size * 8 * headroom:
        num //= 2
    return num


@dataclass(frozen=True)
class Decoded:
    """Rows the region decoder returned: whole num/8-scaled rows from ``top``, starting ``left``."""

    pixels: U8
    top: int
    left: int
    num: int

    def crop(self, c: Crop) -> U8:
        """The scaled pixels whose centres fall in crop ``c`` (edges rounded to the nearest scaled
        pixel), so a scaled crop is not biased towards zooming out."""
        y0, y1 = _nearest(c.top, self.num) - self.top, _nearest(c.top + c.height, self.num) - self.top
        x0, x1 = _nearest(c.left, self.num) - self.left, _nearest(c.left + c.width, self.num) - self.left
        return self.pixels[y0:y1, x0:x1]

    def place(self, canvas: U8) -> None:
        """Write the rows where they belong in an image-sized (scaled) canvas."""
        rows, cols = self.pixels.shape[:2]
        canvas[self.top : self.top + rows, self.left : self.left + cols] = self.pixels


def decode_region(data: bytes, c: Crop, num: int) -> Decoded | None:
    """The rows covering crop ``c`` at ``num``/8 scale, or None if libjpeg-turbo refused the file."""
    assert _jpegcrop is not None
    try:
        pixels, rows, row_width, skip = _jpegcrop.decode(data, c.top, c.left, c.height, c.width, num)
    except ValueError:
        return None
    array = np.frombuffer(pixels, dtype=np.uint8).reshape(rows, row_width, 3)
    # A row starts ``skip`` pixels left of the crop's first scaled column (an iMCU boundary).
    return Decoded(array, c.top * num // 8, c.left * num // 8 - skip, num)


def _nearest(full_px: int, num: int) -> int:
    """A full-size pixel edge in num/8-scaled pixels, rounded half up."""
    return (full_px * num + 4) // 8
