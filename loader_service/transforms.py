"""Decode one image file and write it, transformed, into a ``3 x S x S`` uint8 row of a slot.

All three transforms end in one strided numpy copy that turns OpenCV's BGR HWC into RGB CHW directly
in shared memory (and applies the horizontal flip in the same pass), so no batch-sized intermediate
buffer exists. Resizing uses area interpolation when shrinking (anti-aliased, like torchvision's
``antialias=True``) and bilinear when enlarging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import cv2
import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


class DecodeError(Exception):
    """A file that is not a decodable image; ``str()`` is the reason logged and reported."""


@dataclass(frozen=True)
class Crop:
    top: int
    left: int
    height: int
    width: int


def decode_file(path: str) -> U8:
    """Read and decode to BGR HWC uint8 (EXIF orientation applied, alpha dropped, 16-bit scaled)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DecodeError(f"cannot read: {exc.strerror or exc}") from None
    if not data:
        raise DecodeError("empty file")
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


def _resize(image: U8, width: int, height: int) -> U8:
    shrinking = width * height < image.shape[0] * image.shape[1]
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    return cast(U8, cv2.resize(image, (width, height), interpolation=interpolation))


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


def apply_train(image: U8, out: U8, rng: np.random.Generator) -> None:
    size = out.shape[1]
    c = random_resized_crop_params(rng, image.shape[0], image.shape[1])
    crop = image[c.top : c.top + c.height, c.left : c.left + c.width]
    _store(_resize(crop, size, size), out, flip=bool(rng.random() < 0.5))


def apply_eval(image: U8, out: U8) -> None:
    size = out.shape[1]
    new_h, new_w, c = eval_geometry(image.shape[0], image.shape[1], size)
    resized = cast(U8, cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_AREA))
    _store(resized[c.top : c.top + size, c.left : c.left + size], out)


def apply_none(image: U8, out: U8) -> None:
    size = out.shape[1]
    _store(_resize(image, size, size), out)


def transform_into(image: U8, out: U8, augment: str, rng: np.random.Generator) -> None:
    """Write ``image`` (BGR HWC) transformed by ``augment`` into ``out`` (RGB CHW, ``3 x S x S``)."""
    if augment == "train":
        apply_train(image, out, rng)
    elif augment == "eval":
        apply_eval(image, out)
    else:
        apply_none(image, out)
