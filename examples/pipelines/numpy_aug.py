"""An ImageNet-style pipeline in numpy and OpenCV only: no torch, no torchvision.

    loader-service serve --data /data/train.csv --pipeline examples/pipelines/numpy_aug.py:train
    loader-service serve --data /data/val.csv --pipeline examples/pipelines/numpy_aug.py:evaluate

Each function gets the sample (``sample["image"]`` is RGB HWC uint8) and ``rng``, a numpy Generator
drawn from (seed, epoch, index): every random choice comes from it, so a sample's output is the same
whichever decode worker makes it. Both return ``image`` float16 ``3 x 224 x 224`` (normalised CHW)
and ``label`` int64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import cv2
import numpy as np
import numpy.typing as npt

SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255
LUMA = np.array([0.299, 0.587, 0.114], np.float32)
JITTER = 0.4
"""Brightness, contrast and saturation factors are drawn from [1 - JITTER, 1 + JITTER]."""

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def train(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Random resized crop, horizontal flip, colour jitter, normalisation."""
    image: U8 = sample["image"]
    top, left, height, width = random_resized_crop(rng, *image.shape[:2])
    crop = resize(image[top : top + height, left : left + width], SIZE, SIZE)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return {"image": normalise(jitter(crop.astype(np.float32), rng)), "label": np.int64(sample["label"])}


def evaluate(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Shorter side to 256, centre 224 crop, normalisation: no randomness."""
    image: U8 = sample["image"]
    height, width = image.shape[:2]
    scale = round(SIZE * 256 / 224) / min(height, width)
    resized = resize(image, max(SIZE, round(height * scale)), max(SIZE, round(width * scale)))
    top = (resized.shape[0] - SIZE) // 2
    left = (resized.shape[1] - SIZE) // 2
    crop = resized[top : top + SIZE, left : left + SIZE]
    return {"image": normalise(crop.astype(np.float32)), "label": np.int64(sample["label"])}


def random_resized_crop(
    rng: np.random.Generator, height: int, width: int, scale: tuple[float, float] = (0.08, 1.0)
) -> tuple[int, int, int, int]:
    """(top, left, height, width) as torchvision's RandomResizedCrop draws them."""
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        area = height * width * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def resize(image: U8, height: int, width: int) -> U8:
    shrinking = height * width < image.shape[0] * image.shape[1]
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    return cast(U8, cv2.resize(image, (width, height), interpolation=interpolation))


def jitter(pixels: F32, rng: np.random.Generator) -> F32:
    """Brightness, contrast and saturation, each scaled by a random factor, in HWC float32."""
    brightness, contrast, saturation = rng.uniform(1 - JITTER, 1 + JITTER, size=3).astype(np.float32)
    pixels *= brightness
    mean = (pixels @ LUMA).mean()
    pixels = (pixels - mean) * contrast + mean
    gray = (pixels @ LUMA)[..., None]
    pixels = (pixels - gray) * saturation + gray
    return np.clip(pixels, 0, 255, out=pixels)


def normalise(pixels: F32) -> npt.NDArray[np.float16]:
    """HWC 0..255 to CHW float16, per-channel standardised."""
    return np.ascontiguousarray(((pixels - MEAN) / STD).transpose(2, 0, 1), dtype=np.float16)
