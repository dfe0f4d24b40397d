"""A training pipeline with albumentations 2.x: crop, flip, colour and blur, then normalised float16.

    pip install 'albumentations>=2'
    loader-service serve --data /data/train.csv --pipeline examples/pipelines/albumentations_aug.py:train

albumentations 2.x draws its randomness from a generator its ``Compose`` owns, not from Python's or
numpy's global ones (which the service reseeds before every call). So the function reseeds the
``Compose`` from ``rng`` first: the sample's augmentation then depends only on (seed, epoch, index),
whichever decode worker runs it and whatever that worker ran before. Without that line, a worker
restarted mid-epoch, or a resumed epoch, would give the same sample other pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import albumentations as alb
import numpy as np

SIZE = 224

TRAIN = alb.Compose(
    [
        alb.RandomResizedCrop(size=(SIZE, SIZE), scale=(0.08, 1.0)),
        alb.HorizontalFlip(p=0.5),
        alb.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.0, p=0.8),
        alb.GaussianBlur(blur_limit=(3, 7), p=0.2),
        alb.Normalize(),  # ImageNet mean and std, to float32
    ]
)


def train(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    TRAIN.set_random_seed(int(rng.integers(2**31)))  # the determinism line: see the docstring
    image = TRAIN(image=sample["image"])["image"]  # HWC float32
    return {
        "image": np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float16),
        "label": np.int64(sample["label"]),
    }
