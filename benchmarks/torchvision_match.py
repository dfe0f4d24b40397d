"""How close the built-in transforms come to torchvision's, filter by filter, on the same crops.

    python -m benchmarks.torchvision_match                 # synthetic photos
    python -m benchmarks.torchvision_match --images DIR    # your own photos too

Needs torchvision (``pip install 'dataferry[pipelines]'``). For every image, with the crop and flip
the service draws for it:

- train: ``transforms.Recipe("train", filter)`` (a full decode) against torchvision v2's
  ``resized_crop`` + ``horizontal_flip`` with the same crop, on the same decoded pixels as a tensor
  (``antialias=True``, torchvision's default) and on a PIL image (PIL's own decode and bilinear
  filter: what ``ImageFolder`` + ``RandomResizedCrop`` does by default);
- eval: ``Recipe("eval", filter)`` against ``Resize(round(S * 256 / 224))`` + ``CenterCrop(S)``, the
  same two ways (NOTE [ Eval regions ] in ``transforms.py`` says why ours crops first).

Reported per pair: mean and maximum absolute difference in levels (0-255) and the share of pixels
that differ by more than 2 levels.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image

from benchmarks.dct_scaling import folder_set, synthetic_set
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.transforms import Recipe, transform_into
from protocol.pixels.geometry import random_resized_crop_params
from protocol.pixels.render import decode_bytes

Reference = Callable[[bytes, np.random.Generator, int, str], np.ndarray]


@dataclass(frozen=True)
class Match:
    images: str
    augment: str
    interpolation: str
    reference: str
    mean_abs: float
    max_abs: int
    over_2: float


def _v2() -> tuple[Any, Any]:
    """torchvision's v2 functional module and InterpolationMode, imported only when needed."""
    # By name: torchvision is optional, and not installed where the type checker runs.
    functional = importlib.import_module("torchvision.transforms.v2.functional")
    return functional, importlib.import_module("torchvision.transforms").InterpolationMode


def _tensor(data: bytes) -> torch.Tensor:
    """The same pixels OpenCV decodes for the service, as torchvision's uint8 CHW RGB tensor."""
    rgb = cv2.cvtColor(decode_bytes(data), cv2.COLOR_BGR2RGB)
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


def _pil(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as opened:
        return opened.convert("RGB")


def _as_chw(image: torch.Tensor | Image.Image) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image).transpose(2, 0, 1)
    return image.numpy()


def train_reference(kind: str) -> Reference:
    def run(data: bytes, rng: np.random.Generator, size: int, interpolation: str) -> np.ndarray:
        functional, mode = _v2()
        image = _tensor(data) if kind == "tensor" else _pil(data)
        height, width = functional.get_size(image)
        c = random_resized_crop_params(rng, height, width)
        box = (c.top, c.left, c.height, c.width)
        out = functional.resized_crop(image, *box, [size, size], mode.BILINEAR, antialias=True)
        if rng.random() < 0.5:
            out = functional.horizontal_flip(out)
        return _as_chw(out)

    return run


def eval_reference(kind: str) -> Reference:
    def run(data: bytes, rng: np.random.Generator, size: int, interpolation: str) -> np.ndarray:
        functional, mode = _v2()
        image = _tensor(data) if kind == "tensor" else _pil(data)
        resized = functional.resize(image, [round(size * 256 / 224)], mode.BILINEAR, antialias=True)
        return _as_chw(functional.center_crop(resized, [size, size]))

    return run


REFERENCES: dict[str, dict[str, Reference]] = {
    "train": {"torchvision tensor": train_reference("tensor"), "torchvision PIL": train_reference("pil")},
    "eval": {"torchvision tensor": eval_reference("tensor"), "torchvision PIL": eval_reference("pil")},
}


def compare(label: str, images: Sequence[bytes], augment: str, interpolation: str, size: int) -> list[Match]:
    found = []
    ours = np.empty((3, size, size), np.uint8)
    for name, reference in REFERENCES[augment].items():
        diffs = []
        for seed, data in enumerate(images):
            transform_into(
                decode_bytes(data), ours, Recipe(augment, interpolation), np.random.default_rng(seed)
            )
            theirs = reference(data, np.random.default_rng(seed), size, interpolation)
            diffs.append(np.abs(ours.astype(np.int16) - theirs.astype(np.int16)))
        d = np.stack(diffs)
        found.append(
            Match(label, augment, interpolation, name, float(d.mean()), int(d.max()), float((d > 2).mean()))
        )
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchvision_match")
    parser.add_argument("--count", type=int, default=40, help="synthetic photos")
    parser.add_argument("--size", type=int, default=224, help="output side S")
    parser.add_argument("--images", type=Path, help="a folder of your own images, added as one more set")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    cv2.setNumThreads(1)
    sets = {"synthetic 500x375": synthetic_set(375, 500, args.count, seed=375)}
    if args.images:
        sets[f"folder ({args.images.name})"] = folder_set(args.images)
    rows = []
    for label, images in sets.items():
        for augment in ("train", "eval"):
            for interpolation in INTERPOLATIONS:
                for m in compare(label, images, augment, interpolation, args.size):
                    rows.append(m)
                    print(
                        f"{m.images:>18} {m.augment:>5} {m.interpolation:>18} vs {m.reference:<18} "
                        f"mean |diff| {m.mean_abs:5.2f}  max {m.max_abs:3d}  >2 levels {m.over_2:6.2%}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
