"""Decode one image file and write it, transformed, into a ``3 x S x S`` uint8 row of a slot.

All three transforms end in one strided numpy copy that turns OpenCV's BGR HWC into RGB CHW directly
in shared memory (and applies the horizontal flip in the same pass), so no batch-sized intermediate
buffer exists. The resize filter is the feed's ``interpolation`` (``geometry.INTERPOLATIONS``).

``load_bytes_into`` is the service's entry point (``load_into`` reads a file first). For the train
and eval transforms on a JPEG it can find the crop from the header alone and decode only that region
(``regions``). The crop and flip drawn are the ones a full decode would get. Where the files come
from is the storage layer's job (``dataset.storage``); what the geometry is, ``geometry``'s; which
decoder runs, ``decoders``'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import cv2
import numpy as np

from loader_service.dataset.storage.local import DEFAULT_MAX_FILE_BYTES, read_file
from loader_service.dataset.tables import DecodeError
from loader_service.decode import regions
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.geometry import (
    U8,
    eval_geometry,
    random_resized_crop_params,
    resize,
)
from loader_service.decode.regions import (
    ROI_HEADROOM,
    decode_region,
    eval_region,
    roi_header,
    roi_scale,
    whole_jpeg,
)


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


def _store(hwc_bgr: U8, out: U8, flip: bool = False) -> None:
    """Copy BGR HWC into the RGB CHW row ``out``, optionally mirrored, in one pass."""
    view = hwc_bgr[:, ::-1, ::-1] if flip else hwc_bgr[:, :, ::-1]
    np.copyto(out, view.transpose(2, 0, 1))


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
    if recipe.roi and recipe.augment != "none" and regions.built() and whole_jpeg(data):
        size = roi_header(data)
        if size is not None:
            _roi_transform(data, size, out, recipe, rng)
            return
    transform_into(decode_bytes(data), out, recipe, rng)


def _roi_transform(
    data: bytes, size: tuple[int, int], out: U8, recipe: Recipe, rng: np.random.Generator
) -> None:
    """The train or eval transform with only what it needs decoded, DCT-scaled where that is large."""
    headroom = ROI_HEADROOM[recipe.interpolation] if recipe.dct_scaling else math.inf
    if recipe.augment == "eval":
        _roi_eval(data, size, out, recipe.interpolation, headroom)
        return
    c = random_resized_crop_params(rng, *size)
    decoded = decode_region(data, c, roi_scale(c, out.shape[1], headroom))
    if decoded is None:  # same crop, same rng position: the fallback yields what this path would have
        region = decode_bytes(data)[c.top : c.top + c.height, c.left : c.left + c.width]
    else:
        region = decoded.crop(c)
    _finish_train(region, out, rng, recipe.interpolation)


def _roi_eval(data: bytes, size: tuple[int, int], out: U8, interpolation: str, headroom: float) -> None:
    """Eval on a canvas holding only the centre's region (NOTE [ Eval regions ])."""
    height, width = size
    num = roi_scale(eval_region(height, width, out.shape[1]), out.shape[1], headroom)
    decoded = decode_region(data, eval_region(height, width, out.shape[1], num), num)
    if decoded is None:
        apply_eval(decode_bytes(data), out, interpolation)
        return
    # libjpeg-turbo's scaled image is ceil(side * num / 8) pixels on each side.
    canvas = np.empty((-(-height * num // 8), -(-width * num // 8), 3), np.uint8)
    decoded.place(canvas)
    apply_eval(canvas, out, interpolation, full=size)
