"""Where a transform takes its pixels from, and how it resizes them: RandomResizedCrop's draw, eval's
geometry, and the resize filters (``contract.INTERPOLATIONS``), each exactly as torchvision computes it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import cv2
import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]

_resample: ModuleType | None
try:
    from protocol.pixels import _resample
except ImportError:  # built wherever a C compiler was found at install time
    _resample = None

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


@dataclass(frozen=True)
class Crop:
    top: int
    left: int
    height: int
    width: int


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
