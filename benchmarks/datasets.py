"""The images every contender reads, and the torch Datasets the DataLoader contenders use.

Both Datasets do the service's work per sample: decode, RandomResizedCrop to ``S`` (scale 0.08-1,
ratio 3/4-4/3, torchvision's sampling) with a horizontal flip at p=0.5, RGB CHW uint8. The OpenCV one
calls the service's own ``decode_file`` and ``transform_into`` with the service's ``Recipe`` (its
transform and resize filter), so the two differ only in how the work is scheduled and delivered. The
PIL one is what a torchvision user writes (``Image.open`` + ``convert("RGB")``, crop, bilinear
``resize``, ``transpose`` for the flip), without torchvision. (k)'s ``PlainEval`` is a user's own
OpenCV eval code, written as one would without the service's.

(h) runs a user pipeline, ``FUNC(sample, rng)``, in a DataLoader (``PipelineSamples``), on the same
samples in the same order as the service (``EpochOrder``), so both deliver the same batches. (i) reads
the sample dataset again as WebDataset tar shards (``make_shards``), cached beside it.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import cv2
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from benchmarks.config import CLASSES, BenchConfig
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.sampler import epoch_permutation, sample_rng
from loader_service.decode.pipeline import load_pipeline, seed_globals
from loader_service.decode.transforms import Recipe, decode_file, transform_into
from protocol.pixels.geometry import random_resized_crop_params
from protocol.pixels.render import decode_bytes

Sample = tuple[torch.Tensor, int]
Fields = dict[str, Any]
"""What a pipeline returns for one sample, and (collated) a DataLoader's batch of them."""
UserFunction = Callable[[Mapping[str, Any], np.random.Generator], object]
"""A pipeline as a DataLoader calls it: with a plain dict where the service passes its lazy Sample."""
SampleKey = tuple[int, int]
"""(epoch, index): what ``EpochOrder`` hands ``PipelineSamples`` for each sample."""
SHARD_SAMPLES = 256
"""Samples per tar shard made for (i): 10 shards for the full run's 2560 images."""
SHARDS_STAMP = "SOURCE"
ZIP_NAME = "train.zip"
"""File in a shard folder naming the dataset it was made from; shards are remade when it differs."""


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
    ours = re.compile(rf"^{CLASSES}x\d+-seed\d+(-tar)?$")
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
    """The service's decode and transform, called per sample from DataLoader workers: a full decode,
    then ``recipe``'s transform and filter (never the region decoder: ``recipe.roi`` is ignored)."""

    def __init__(self, root: Path, size: int, recipe: Recipe | None = None) -> None:
        super().__init__(root, size)
        recipe = recipe or Recipe()
        self.recipe = Recipe(recipe.augment, recipe.interpolation)

    def __getitem__(self, i: int) -> Sample:
        out = np.empty((3, self.size, self.size), dtype=np.uint8)
        transform_into(decode_file(str(self.index.path(i))), out, self.recipe, self.rng())
        return torch.from_numpy(out), int(self.index.labels[i])


class PlainEval(_CropDataset):
    """(k): the eval code a DataLoader user writes with OpenCV alone: ``cv2.imread``, the shorter side
    resized to round(S * 256 / 224) with ``cv2.resize``'s default INTER_LINEAR, a centred S x S crop,
    BGR to RGB, CHW."""

    def __getitem__(self, i: int) -> Sample:
        image = cv2.imread(str(self.index.path(i)), cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError(f"cv2.imread could not read {self.index.relpath(i)}")
        height, width = image.shape[:2]
        short = round(self.size * 256 / 224)
        scale = short / min(height, width)
        new_w, new_h = max(short, int(width * scale)), max(short, int(height * scale))
        resized = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        top, left = (new_h - self.size) // 2, (new_w - self.size) // 2
        crop = resized[top : top + self.size, left : left + self.size, ::-1]
        pixels = torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1)))
        return pixels, int(self.index.labels[i])


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


# --- (h): a user pipeline in a DataLoader -----------------------------------------------------------


class EpochOrder(Sampler[SampleKey]):
    """The service's sample order, epoch after epoch, as (epoch, index) keys.

    Each ``iter()`` (a DataLoader's epoch) walks the next epoch's ``epoch_permutation(seed, epoch, n)``,
    the order a service with the same seed delivers; the epoch travels with each index because the
    pipeline's randomness is drawn from (seed, epoch, index).
    """

    def __init__(self, samples: int, seed: int) -> None:
        self.samples = samples
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return self.samples

    def __iter__(self) -> Iterator[SampleKey]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return ((epoch, i) for i in epoch_permutation(self.seed, epoch, self.samples).tolist())


class PipelineSamples(Dataset[Fields]):
    """``FUNC(sample, rng)`` per sample, as a DataLoader user runs a pipeline, doing what the service's
    decode workers do for it: read the file, decode it as ``sample["image"]`` is decoded
    (``decode_bytes``, then BGR to RGB), reseed the global generators and draw ``rng`` from (seed,
    epoch, index) (NOTE [ Pipeline determinism ]), so both give the same fields for the same sample.

    The sample is a plain dict, decoded up front: a pipeline that reads ``image`` (as (h)'s does) costs
    the same either way. The function is imported in each worker on first use, after
    ``load_pipeline`` has made torch and OpenCV single-threaded there as in the service's workers.
    """

    def __init__(self, data: Path, pipeline: str, seed: int) -> None:
        self.index: DatasetIndex = build_index(data)
        self.pipeline = pipeline
        self.seed = seed
        self._fn: UserFunction | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        """A spawned worker imports the function itself: one loaded from a file does not pickle."""
        return {**self.__dict__, "_fn": None}

    def function(self) -> UserFunction:
        if self._fn is None:
            self._fn = cast(UserFunction, load_pipeline(self.pipeline))
        return self._fn

    def sample(self, epoch: int, i: int) -> Fields:
        """What the pipeline's ``sample`` mapping holds for sample ``i`` (the index has no metadata)."""
        data = self.index.path(i).read_bytes()
        return {
            "image": cv2.cvtColor(decode_bytes(data), cv2.COLOR_BGR2RGB),
            "bytes": data,
            "label": int(self.index.labels[i]),
            "index": i,
            "epoch": epoch,
            "path": self.index.relpath(i),
        }

    def __getitem__(self, key: SampleKey) -> Fields:
        epoch, i = key
        fn = self.function()
        sample = self.sample(epoch, i)
        seed_globals(self.seed, epoch, i)
        result = fn(sample, sample_rng(self.seed, epoch, i))
        if not isinstance(result, dict):
            raise TypeError(f"pipeline {self.pipeline} returned a {type(result).__name__}, not a dict")
        return result


def make_pipeline_dataloader(
    dataset: PipelineSamples, workers: int, batch_size: int, timeout: float
) -> DataLoader[Fields]:
    """``make_dataloader`` for a pipeline: the service's order instead of ``shuffle=True``, default
    collate of the returned dicts (a dict of stacked tensors per batch)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochOrder(len(dataset), dataset.seed),
        num_workers=workers,
        persistent_workers=True,
        worker_init_fn=single_threaded_worker,
        timeout=timeout,
    )


# --- (i): the same images as tar shards --------------------------------------------------------------


def shard_groups(samples: int, per_shard: int) -> list[range]:
    """Sample indices of each shard, in index order: consecutive runs of ``per_shard`` (the last shorter)."""
    if per_shard < 1:
        raise ValueError(f"per_shard must be at least 1, got {per_shard}")
    return [range(start, min(start + per_shard, samples)) for start in range(0, samples, per_shard)]


def sample_key(i: int) -> str:
    """A shard member's key (its name up to the first dot): the sample's index, zero-padded."""
    return f"{i:06d}"


def shards_folder(cfg: BenchConfig, root: Path) -> Path:
    """Where (i)'s shards of the dataset at ``root`` are kept: beside it in the cache."""
    return cfg.cache / f"{root.name}-tar"


def source_stamp(index: DatasetIndex) -> str:
    """What the shards were made from: the dataset's order and labels, and its files' total size."""
    total = sum(index.path(i).stat().st_size for i in range(len(index)))
    return f"{index.fingerprint()} {len(index)} {total}"


def made_once(index: DatasetIndex, folder: Path, write: Callable[[Path], object]) -> Path:
    """``folder``, filled by ``write`` with the images of ``index`` in some format: made once, kept
    while its stamp matches the dataset, written to a sibling folder and renamed, so an interrupted
    run never leaves half of it looking complete."""
    stamp = source_stamp(index)
    if (folder / SHARDS_STAMP).is_file() and (folder / SHARDS_STAMP).read_text().strip() == stamp:
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    (partial / SHARDS_STAMP).write_text(stamp + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def make_shards(index: DatasetIndex, folder: Path, per_shard: int = SHARD_SAMPLES) -> Path:
    """The images of ``index`` as WebDataset shards ``train-NNNNNN.tar`` in ``folder``: per sample, in
    index order, ``KEY.jpg`` (the file's bytes, under its own extension) then ``KEY.cls`` (the label).
    Made once (``made_once``)."""

    def write(out: Path) -> None:
        for number, group in enumerate(shard_groups(len(index), per_shard)):
            with tarfile.open(out / f"train-{number:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in group:
                    _add_sample(tar, index, i)

    return made_once(index, folder, write)


def zip_path(cfg: BenchConfig, root: Path, stored: bool = False) -> Path:
    """Where (i)'s zip archive of the dataset at ``root`` is kept: a folder beside it in the cache."""
    return cfg.cache / f"{root.name}-zip{'-stored' if stored else ''}"


def make_zip(index: DatasetIndex, folder: Path, stored: bool = False) -> Path:
    """The images of ``index`` as one zip archive of their class folders, ``folder/train.zip``,
    deflated as ``zip -r`` leaves them (JPEGs barely shrink; every member still inflates on read), or
    ``stored`` as ``zip -0`` leaves them. Made once (``made_once``); returns the archive."""

    def write(out: Path) -> None:
        with zipfile.ZipFile(
            out / ZIP_NAME, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
        ) as z:
            for i in range(len(index)):
                z.write(index.path(i), index.relpath(i))

    return made_once(index, folder, write) / ZIP_NAME


def saved_path(cfg: BenchConfig, root: Path) -> Path:
    """Where (i)'s ``save_to_disk`` folder of the dataset at ``root`` is kept: beside it in the cache."""
    return cfg.cache / f"{root.name}-arrow"


def make_saved(index: DatasetIndex, folder: Path) -> Path:
    """The images of ``index`` as the folder ``datasets.Dataset.save_to_disk`` writes (an ``Image``
    column, a ``ClassLabel``), in index order. Made once (``made_once``). Needs ``datasets``."""
    import datasets

    def write(out: Path) -> None:
        rows = range(len(index))
        table = {
            "image": [{"bytes": index.path(i).read_bytes(), "path": None} for i in rows],
            "label": [int(index.labels[i]) for i in rows],
        }
        features = datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(index.classes))}
        )
        datasets.Dataset.from_dict(table, features=features).save_to_disk(str(out))

    return made_once(index, folder, write)


def tfrecord_path(cfg: BenchConfig, root: Path) -> Path:
    """Where (i)'s TFRecord files of the dataset at ``root`` are kept: beside it in the cache."""
    return cfg.cache / f"{root.name}-tfrecord"


def make_tfrecords(index: DatasetIndex, folder: Path, per_file: int = SHARD_SAMPLES) -> Path:
    """The images of ``index`` as TFRecord files of ``tf.train.Example`` (``image/encoded``,
    ``image/class/label``), ``per_file`` records each, named as TensorFlow's scripts name them.
    Made once (``made_once``). Needs the ``tfrecord`` package."""
    from tfrecord import TFRecordWriter

    def write(out: Path) -> None:
        groups = list(shard_groups(len(index), per_file))
        for number, group in enumerate(groups):
            writer = TFRecordWriter(str(out / f"train-{number:05d}-of-{len(groups):05d}"))
            for i in group:
                example = {
                    "image/encoded": (index.path(i).read_bytes(), "byte"),
                    "image/class/label": (int(index.labels[i]), "int"),
                }
                writer.write(example)
            writer.close()

    return made_once(index, folder, write)


def _add_sample(tar: tarfile.TarFile, index: DatasetIndex, i: int) -> None:
    path = index.path(i)
    key = sample_key(i)
    tar.add(path, arcname=f"{key}.{path.suffix.lower().lstrip('.')}", recursive=False)
    label = str(int(index.labels[i])).encode()
    member = tarfile.TarInfo(f"{key}.cls")
    member.size = len(label)
    tar.addfile(member, io.BytesIO(label))
