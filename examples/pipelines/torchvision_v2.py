"""An ImageNet training pipeline with torchvision.transforms.v2: TrivialAugmentWide, then float16.

    pip install 'dataferry[pipelines]'   # torchvision, built for the same torch as the service's
    loader-service serve --data /data/train --pipeline examples/pipelines/torchvision_v2.py:train
    loader-service serve --data /data/val --pipeline examples/pipelines/torchvision_v2.py:evaluate

Both return ``image`` float16 ``3 x 224 x 224`` (normalised CHW) and ``label`` int64. torchvision
draws its randomness from torch's global generator; the service reseeds it (and Python's ``random``
and numpy's global generator) from (seed, epoch, index) before every call, so a sample's crop and
augmentation are the same whichever decode worker makes it, and the ``rng`` argument goes unused.
Workers run torch single-threaded: one worker is one core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

SIZE = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

TRAIN = v2.Compose(
    [
        v2.ToImage(),  # the sample's RGB HWC uint8 array -> a CHW uint8 tensor, sharing its memory
        v2.RandomResizedCrop(SIZE, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.TrivialAugmentWide(),  # or v2.RandAugment(): both work on uint8
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
        v2.ToDtype(torch.float16),
    ]
)

EVAL = v2.Compose(
    [
        v2.ToImage(),
        v2.Resize(round(SIZE * 256 / 224), antialias=True),
        v2.CenterCrop(SIZE),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
        v2.ToDtype(torch.float16),
    ]
)


def train(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {"image": TRAIN(sample["image"]), "label": torch.tensor(sample["label"], dtype=torch.int64)}


def evaluate(sample: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {"image": EVAL(sample["image"]), "label": torch.tensor(sample["label"], dtype=torch.int64)}
