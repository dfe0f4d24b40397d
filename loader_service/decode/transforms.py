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

import numpy as np

from loader_service.dataset.storage.local import DEFAULT_MAX_FILE_BYTES, read_file
from loader_service.decode.contract import INTERPOLATIONS
from protocol.encoded import EVAL, TRAIN, EncodedRow
from protocol.pixels import regions
from protocol.pixels.geometry import (
    U8,
    random_resized_crop_params,
    resize,
)
from protocol.pixels.regions import (
    ROI_HEADROOM,
    eval_region,
    roi_header,
    roi_scale,
    whole_jpeg,
)
from protocol.pixels.render import apply_eval, decode_bytes, render, store


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


def apply_train(image: U8, out: U8, rng: np.random.Generator, interpolation: str) -> None:
    c = random_resized_crop_params(rng, image.shape[0], image.shape[1])
    _finish_train(image[c.top : c.top + c.height, c.left : c.left + c.width], out, rng, interpolation)


def _finish_train(crop: U8, out: U8, rng: np.random.Generator, interpolation: str) -> None:
    """Resize the crop into ``out`` and draw the flip: what follows the crop draw on either path."""
    size = out.shape[1]
    store(resize(crop, size, size, interpolation), out, flip=bool(rng.random() < 0.5))


def apply_none(image: U8, out: U8, interpolation: str) -> None:
    size = out.shape[1]
    store(resize(image, size, size, interpolation), out)


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

    With ``recipe.roi`` train and eval decode only their crop where they can (module docstring):
    what ``plan_row`` decides, ``render`` makes. Every other case is
    ``transform_into(decode_bytes(data), ...)``.
    """
    planned = plan_row(data, out.shape[1], recipe, rng)
    if planned is None:
        transform_into(decode_bytes(data), out, recipe, rng)
    else:
        render(data, planned, out, check=False)


def plan_row(data: bytes, size: int, recipe: Recipe, rng: np.random.Generator) -> EncodedRow | None:
    """What the region decoder's path decides for the file ``data`` and an ``size`` output, the
    seeded draws made (crop, then flip, as a whole decode draws them): the row an encoded row
    carries (NOTE [ Encoded rows ]), its bytes still to be placed (offset 0). None where that path
    does not take the file (not a whole JPEG the region decoder reads exactly as OpenCV would, or a
    recipe without a crop): it is decoded whole, and never sent encoded."""
    if not (recipe.roi and recipe.augment != "none" and regions.built() and whole_jpeg(data)):
        return None
    found = roi_header(data)
    if found is None:
        return None
    height, width = found
    headroom = ROI_HEADROOM[recipe.interpolation] if recipe.dct_scaling else math.inf
    if recipe.augment == "eval":
        num = roi_scale(eval_region(height, width, size), size, headroom)
        c, mode, flip = eval_region(height, width, size, num), EVAL, False
    else:
        c = random_resized_crop_params(rng, height, width)
        num = roi_scale(c, size, headroom)
        mode, flip = TRAIN, bool(rng.random() < 0.5)
    return EncodedRow(
        0, len(data), mode, flip, height, width, c.top, c.left, c.height, c.width, num, recipe.interpolation
    )
