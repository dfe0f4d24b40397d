"""The images every contender reads, and the torch Datasets the DataLoader contenders use.

Both Datasets do the service's work per sample: decode, RandomResizedCrop to ``S`` (scale 0.08-1,
ratio 3/4-4/3, torchvision's sampling) with a horizontal flip at p=0.5, RGB CHW uint8. The OpenCV one
calls the service's own ``decode_file`` and ``transform_into``, so the two differ only in how the
work is scheduled and delivered. The PIL one is what a torchvision user writes (``Image.open`` +
``convert("RGB")``, crop, bilinear ``resize``, ``transpose`` for the flip), without torchvision.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.config import CLASSES, BenchConfig
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.transforms import decode_file, random_resized_crop_params, transform_into

Sample = tuple[torch.Tensor, int]


@dataclass(frozen=True)
class DataSpec:
    """Where the images are and what they are like, without this machine's paths (for reports)."""

    root: Path
    source: str
    images: int
    classes: int
    mean_kib: float
    mean_width: float | None = None
    mean_height: float | None = None

    def describe(self) -> str:
        shape = ""
        if self.mean_width and self.mean_height:
            shape = f", mean {self.mean_width:.0f}x{self.mean_height:.0f}"
        return f"{self.source}: {self.images} images, {self.classes} classes{shape}, {self.mean_kib:.0f} KiB"

    def public(self) -> dict[str, Any]:
        """The facts a report may show: no absolute path of this machine."""
        return {
            "source": self.source,
            "images": self.images,
            "classes": self.classes,
            "mean_kib": round(self.mean_kib, 1),
            "mean_width": self.mean_width,
            "mean_height": self.mean_height,
        }


def prepare_data(cfg: BenchConfig, progress: Callable[[int, int], None] | None = None) -> DataSpec:
    """``--data`` as given, or the sample dataset of ``cfg.images`` images (generated once, then reused)."""
    if cfg.data is not None:
        return _describe_user_data(cfg.data)
    from loader_service.tools.sample_data import make_sample_dataset

    keep_out_of_git(cfg.cache)
    root = cfg.cache / f"{CLASSES}x{cfg.per_class}-seed{cfg.seed}"
    summary = make_sample_dataset(
        root, classes=CLASSES, per_class=cfg.per_class, seed=cfg.seed, progress=progress
    )
    return DataSpec(
        root=root,
        source="generated photo-like JPEGs (loader_service.tools.sample_data)",
        images=summary.images,
        classes=summary.classes,
        mean_kib=summary.total_bytes / summary.images / 1024,
        mean_width=summary.mean_width,
        mean_height=summary.mean_height,
    )


def keep_out_of_git(cache: Path) -> None:
    """Give the cache a ``.gitignore`` of ``*`` (as pytest does for its cache), if it holds only our data.

    Generated datasets are hundreds of MB of JPEGs that a ``git add -A`` must never pick up. A
    directory that holds anything else is left alone: hiding someone's files from git is worse.
    """
    ours = re.compile(rf"^{CLASSES}x\d+-seed\d+$")
    cache.mkdir(parents=True, exist_ok=True)
    ignore = cache / ".gitignore"
    if not ignore.exists() and all(ours.match(p.name) for p in cache.iterdir()):
        ignore.write_text("# made by python -m benchmarks: generated sample data, never commit\n*\n")


def _describe_user_data(root: Path) -> DataSpec:
    index = build_index(root)
    total = sum(index.path(i).stat().st_size for i in range(len(index)))
    return DataSpec(root, "--data", len(index), len(index.classes), total / len(index) / 1024)


class _CropDataset(Dataset[Sample]):
    """Index lookup and per-process randomness shared by both decoders."""

    def __init__(self, root: Path, size: int) -> None:
        self.index: DatasetIndex = build_index(root)
        self.size = size
        self._rng: np.random.Generator | None = None
        self._rng_pid = -1

    def __len__(self) -> int:
        return len(self.index)

    def rng(self) -> np.random.Generator:
        """One generator per worker process, seeded from torch's per-worker seed, as user code would."""
        if self._rng is None or self._rng_pid != os.getpid():
            self._rng = np.random.default_rng(torch.initial_seed() % 2**63)
            self._rng_pid = os.getpid()
        return self._rng


class OpenCVCrops(_CropDataset):
    """The service's decode and transform, called per sample from DataLoader workers."""

    def __getitem__(self, i: int) -> Sample:
        out = np.empty((3, self.size, self.size), dtype=np.uint8)
        transform_into(decode_file(str(self.index.path(i))), out, "train", self.rng())
        return torch.from_numpy(out), int(self.index.labels[i])


class PILCrops(_CropDataset):
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + PILToTensor, in PIL."""

    def __getitem__(self, i: int) -> Sample:
        rng = self.rng()
        with Image.open(self.index.path(i)) as opened:
            image = opened.convert("RGB")
        c = random_resized_crop_params(rng, image.height, image.width)
        box = (c.left, c.top, c.left + c.width, c.top + c.height)
        image = image.crop(box).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8))
        return pixels.permute(2, 0, 1), int(self.index.labels[i])


def single_threaded_worker(worker_id: int) -> None:
    """One OpenCV thread per DataLoader worker, as in the service's decode workers.

    torch already limits itself to one thread in workers; without this OpenCV would use every core in
    each worker, and "the same number of CPU processes" would not mean the same CPU.
    """
    cv2.setNumThreads(1)


def make_dataloader(
    dataset: Dataset[Sample], workers: int, batch_size: int, timeout: float
) -> DataLoader[Sample]:
    """The DataLoader a user would write for this pipeline: shuffled, persistent workers, default collate."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        worker_init_fn=single_threaded_worker,
        timeout=timeout,
    )
