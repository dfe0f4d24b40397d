"""Decode one image file and write it, transformed, into a ``3 x S x S`` uint8 row of a slot.

All three transforms end in one strided numpy copy that turns OpenCV's BGR HWC into RGB CHW directly
in shared memory (and applies the horizontal flip in the same pass), so no batch-sized intermediate
buffer exists. The resize filter is the feed's ``interpolation`` (``INTERPOLATIONS``).

``load_bytes_into`` is the service's entry point (``load_into`` reads a file first). For the train
and eval transforms on a JPEG it can find the crop from the header alone and decode only that region
(see ``_jpegcrop.c``), at 1/2, 1/4 or 1/8 scale when the crop is large (``roi_scale``). The crop and
flip drawn are the ones a full decode would get. Unscaled, the pixels are OpenCV's exactly; scaled,
libjpeg-turbo's DCT scaling replaces the first halvings of the resize, which changes pixels
slightly but not their statistics. Anything the region decoder does not handle (other formats, CMYK,
EXIF rotation, a file not ending in an EOI marker, a decoder error) takes the full OpenCV path.

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
from typing import cast

import cv2
import numpy as np
import numpy.typing as npt

# Reading files is the storage layer's job (dataset.storage).
from loader_service.dataset.storage import DEFAULT_MAX_FILE_BYTES, DecodeError, read_file

U8 = npt.NDArray[np.uint8]

_jpegcrop: ModuleType | None
try:
    from loader_service.decode import _jpegcrop
except ImportError:  # built only where libjpeg-turbo's headers were found at install time
    _jpegcrop = None
_resample: ModuleType | None
try:
    from loader_service.decode import _resample
except ImportError:  # built wherever a C compiler was found at install time
    _resample = None

DECODERS = ("auto", "opencv", "jpeg-roi")
"""``auto``: the region decoder when it is built, else OpenCV; ``jpeg-roi`` insists on it."""

_JPEG_START = b"\xff\xd8\xff"  # what OpenCV requires; libjpeg alone would skip stray bytes
# OpenCV refuses a JPEG that ends before its EOI marker, while the region decoder may never read that
# far; such files (and files with bytes after EOI) go to OpenCV, so both paths reject the same files.
_JPEG_END = b"\xff\xd9"

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)

INTERPOLATIONS = ("bilinear-antialias", "bilinear", "area")
"""The resize filters, default first. ``bilinear-antialias`` is torchvision's default (its tensor
resize, ``antialias=True``; PIL's bilinear is within one level of it); ``bilinear`` is OpenCV's
``INTER_LINEAR``, what a plain ``cv2.resize`` pipeline does; ``area`` is OpenCV's ``INTER_AREA`` when
shrinking (bilinear when enlarging)."""


@dataclass(frozen=True)
class Recipe:
    """How the built-in transforms make one sample: which transform, which filter, which decoder."""

    augment: str = "train"
    """``train`` (RandomResizedCrop + flip), ``eval`` (centre crop) or ``none`` (resize)."""
    interpolation: str = INTERPOLATIONS[0]
    roi: bool = False
    """Decode JPEGs with the region decoder where it can (module docstring)."""
    dct_scaling: bool = True
    """Let the region decoder scale large crops down (``roi_scale``). Without it, every output is
    exactly what a full OpenCV decode gives, which a train feed's sample cache must reproduce."""


@dataclass(frozen=True)
class Crop:
    top: int
    left: int
    height: int
    width: int


def roi_decoder_version() -> str | None:
    """The libjpeg-turbo version the region decoder was built against, or None if it is not built."""
    if _jpegcrop is None:
        return None
    number = int(getattr(_jpegcrop, "LIBJPEG_TURBO_VERSION_NUMBER", 0))
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}"


def decoder_problem(choice: str) -> str | None:
    """Why the ``--decoder`` choice cannot be honoured on this install, or None."""
    if choice not in DECODERS:
        return f"decoder must be one of {', '.join(DECODERS)}"
    if choice == "jpeg-roi" and roi_decoder_version() is None:
        return (
            "decoder jpeg-roi: the region decoder (loader_service.decode._jpegcrop) is not built; install "
            "libjpeg-turbo's headers (Debian: libjpeg-dev) and reinstall dataferry, or use auto"
        )
    return None


def uses_roi(choice: str) -> bool:
    """Whether a (valid) ``--decoder`` choice makes train and eval crops go through the region decoder."""
    return choice != "opencv" and roi_decoder_version() is not None


def describe_decoder(choice: str) -> str:
    """One line for the service log: how the train transform decodes JPEGs, and why."""
    if uses_roi(choice):
        return (
            f"jpeg-roi (libjpeg-turbo {roi_decoder_version()}; train and eval crops decode only their region)"
        )
    if choice == "opencv":
        return "opencv (full decode; --decoder opencv)"
    return "opencv (full decode; the region decoder is not built: see README)"


def decode_file(path: str, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> U8:
    """Read and decode to BGR HWC uint8 (EXIF orientation applied, alpha dropped, 16-bit scaled)."""
    return decode_bytes(read_file(path, max_bytes))


def decode_bytes(data: bytes) -> U8:
    """Decode a whole file's bytes with OpenCV, as ``decode_file`` does."""
    try:
        image = cast(U8 | None, cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR))
    except cv2.error as exc:
        # OpenCV checks OPENCV_IO_MAX_IMAGE_PIXELS against the header before allocating pixels.
        if "MAX_IMAGE_PIXELS" in str(exc):
            raise DecodeError(
                "refused: more pixels than the configured limit (decompression bomb?)"
            ) from None
        raise DecodeError(f"decoder error: {str(exc).strip().splitlines()[-1][:160]}") from None
    if image is None or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
        raise DecodeError("not a decodable image")
    return image


def random_resized_crop_params(rng: np.random.Generator, height: int, width: int) -> Crop:
    """torchvision's RandomResizedCrop.get_params, with numpy randomness."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * rng.uniform(SCALE[0], SCALE[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return Crop(top, left, h, w)
    return _central_fallback(height, width)


def _central_fallback(height: int, width: int) -> Crop:
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return Crop((height - h) // 2, (width - w) // 2, h, w)


def resize(image: U8, width: int, height: int, interpolation: str, window: Crop | None = None) -> U8:
    """``image`` (HWC uint8) resized to ``width`` x ``height`` with the named filter; with ``window``,
    only that part of the result (computed alone where the filter allows, else cut out of it)."""
    if interpolation == "bilinear-antialias" and _resample is not None:
        return _resample_antialias(image, width, height, window or Crop(0, 0, height, width))
    if interpolation == "bilinear-antialias":
        resized = _torch_antialias(image, width, height)
    else:
        shrinking = width * height < image.shape[0] * image.shape[1]
        flag = cv2.INTER_AREA if interpolation == "area" and shrinking else cv2.INTER_LINEAR
        resized = cast(U8, cv2.resize(image, (width, height), interpolation=flag))
    if window is None:
        return resized
    return resized[window.top : window.top + window.height, window.left : window.left + window.width]


def _resample_antialias(image: U8, width: int, height: int, window: Crop) -> U8:
    """torch's anti-aliased bilinear resize (what torchvision's resize calls), as ``_resample.c``
    computes it: exactly torch's bytes, and only the ``window`` of them."""
    assert _resample is not None
    source = np.ascontiguousarray(image)
    out = np.empty((window.height, window.width, 3), np.uint8)
    box = (window.top, window.left, window.height, window.width)
    _resample.resize(source, source.shape[0], source.shape[1], out, height, width, *box)
    return out


def _torch_antialias(image: U8, width: int, height: int) -> U8:
    """The same resize by torch itself, where ``_resample`` is not built."""
    import torch  # imported by ``prepare`` at worker start, so no first batch pays for it
    from torch.nn.functional import interpolate

    # An HWC array viewed as a channels-last NCHW tensor takes torch's uint8 SIMD path.
    # Writable too: a cached image is a read-only view, which torch.from_numpy warns about.
    tensor = torch.from_numpy(np.require(image, requirements=["C", "W"])).permute(2, 0, 1).unsqueeze(0)
    resized = interpolate(tensor, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return cast(U8, resized[0].permute(1, 2, 0).numpy())


def prepare(interpolation: str) -> None:
    """Import what the filter needs now (a decode worker's start), single-threaded as a worker must
    be: torch, for ``bilinear-antialias`` where ``_resample`` is not built (about 130 MB a worker)."""
    if interpolation == "bilinear-antialias" and _resample is None:
        import torch

        torch.set_num_threads(1)


def _store(hwc_bgr: U8, out: U8, flip: bool = False) -> None:
    """Copy BGR HWC into the RGB CHW row ``out``, optionally mirrored, in one pass."""
    view = hwc_bgr[:, ::-1, ::-1] if flip else hwc_bgr[:, :, ::-1]
    np.copyto(out, view.transpose(2, 0, 1))


def eval_geometry(height: int, width: int, size: int) -> tuple[int, int, Crop]:
    """Shorter side to round(size * 256 / 224), then a centred ``size`` crop (torchvision's rules)."""
    short_target = round(size * 256 / 224)
    if height <= width:
        new_h, new_w = short_target, int(short_target * width / height)
    else:
        new_w, new_h = short_target, int(short_target * height / width)
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    return new_h, new_w, Crop(top, left, size, size)


def apply_train(image: U8, out: U8, rng: np.random.Generator, interpolation: str) -> None:
    c = random_resized_crop_params(rng, image.shape[0], image.shape[1])
    _finish_train(image[c.top : c.top + c.height, c.left : c.left + c.width], out, rng, interpolation)


def _finish_train(crop: U8, out: U8, rng: np.random.Generator, interpolation: str) -> None:
    """Resize the crop into ``out`` and draw the flip: what follows the crop draw on either path."""
    size = out.shape[1]
    _store(resize(crop, size, size, interpolation), out, flip=bool(rng.random() < 0.5))


def apply_eval(image: U8, out: U8, interpolation: str, full: tuple[int, int] | None = None) -> None:
    """Resize, then keep the centre. ``full``: the (height, width) whose geometry applies, when
    ``image`` is a DCT-scaled canvas of it, so a scaled decode is cut exactly where a full one is."""
    size = out.shape[1]
    height, width = full or (image.shape[0], image.shape[1])
    new_h, new_w, c = eval_geometry(height, width, size)
    _store(resize(image, new_w, new_h, interpolation, window=c), out)


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


def apply_none(image: U8, out: U8, interpolation: str) -> None:
    size = out.shape[1]
    _store(resize(image, size, size, interpolation), out)


def transform_into(image: U8, out: U8, recipe: Recipe, rng: np.random.Generator) -> None:
    """Write ``image`` (BGR HWC) transformed as ``recipe`` says into ``out`` (RGB CHW, ``3 x S x S``)."""
    if recipe.augment == "train":
        apply_train(image, out, rng, recipe.interpolation)
    elif recipe.augment == "eval":
        apply_eval(image, out, recipe.interpolation)
    else:
        apply_none(image, out, recipe.interpolation)


def load_into(
    path: str,
    out: U8,
    recipe: Recipe,
    rng: np.random.Generator,
    max_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> None:
    """Read the file ``path`` (``read_file``) and write it transformed into ``out``."""
    load_bytes_into(read_file(path, max_bytes), out, recipe, rng)


def load_bytes_into(data: bytes, out: U8, recipe: Recipe, rng: np.random.Generator) -> None:
    """Write the image file's bytes ``data`` transformed into ``out``: the built-in per-sample work.

    With ``recipe.roi`` train and eval decode only their crop where they can (module docstring);
    every other case is ``transform_into(decode_bytes(data), ...)``.
    """
    if recipe.roi and recipe.augment != "none" and _jpegcrop is not None and _whole_jpeg(data):
        size = _roi_header(data)
        if size is not None:
            _roi_transform(data, size, out, recipe, rng)
            return
    transform_into(decode_bytes(data), out, recipe, rng)


def _whole_jpeg(data: bytes) -> bool:
    return data.startswith(_JPEG_START) and data.endswith(_JPEG_END)


def _roi_header(data: bytes) -> tuple[int, int] | None:
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
``python -m benchmarks.dct_scaling`` measured (docs/benchmarks.md). Plain ``bilinear`` never
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


def _roi_transform(
    data: bytes, size: tuple[int, int], out: U8, recipe: Recipe, rng: np.random.Generator
) -> None:
    """The train or eval transform with only what it needs decoded, DCT-scaled where that is large."""
    headroom = ROI_HEADROOM[recipe.interpolation] if recipe.dct_scaling else math.inf
    if recipe.augment == "eval":
        _roi_eval(data, size, out, recipe.interpolation, headroom)
        return
    c = random_resized_crop_params(rng, *size)
    decoded = _decode_region(data, c, roi_scale(c, out.shape[1], headroom))
    if decoded is None:  # same crop, same rng position: the fallback yields what this path would have
        region = decode_bytes(data)[c.top : c.top + c.height, c.left : c.left + c.width]
    else:
        region = decoded.crop(c)
    _finish_train(region, out, rng, recipe.interpolation)


def _roi_eval(data: bytes, size: tuple[int, int], out: U8, interpolation: str, headroom: float) -> None:
    """Eval on a canvas holding only the centre's region (NOTE [ Eval regions ])."""
    height, width = size
    num = roi_scale(eval_region(height, width, out.shape[1]), out.shape[1], headroom)
    decoded = _decode_region(data, eval_region(height, width, out.shape[1], num), num)
    if decoded is None:
        apply_eval(decode_bytes(data), out, interpolation)
        return
    # libjpeg-turbo's scaled image is ceil(side * num / 8) pixels on each side.
    canvas = np.empty((-(-height * num // 8), -(-width * num // 8), 3), np.uint8)
    decoded.place(canvas)
    apply_eval(canvas, out, interpolation, full=size)


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


def _decode_region(data: bytes, c: Crop, num: int) -> Decoded | None:
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
