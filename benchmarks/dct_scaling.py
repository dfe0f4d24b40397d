"""How far the region decoder may DCT-scale a crop before each resize filter: sharpness and speed.

    python -m benchmarks.dct_scaling                     # synthetic photos, 500x375 and 1600x1200
    python -m benchmarks.dct_scaling --sizes 2250x3000 --headrooms 2,3,4 --count 12
    python -m benchmarks.dct_scaling --images DIR --json dct.json   # add your own JPEGs/PNGs

For each filter (``geometry.INTERPOLATIONS``), transform (train crops, eval centre crops) and
headroom (how many times the output size a scaled region must stay, ``regions.roi_scale``), every
image goes through the region path with that headroom and through a full OpenCV decode with the same
crop, flip and filter. Reported per setting: the share of crops that were scaled, the sharpness of
the outputs (mean absolute horizontal gradient) relative to the full decode's, the mean absolute
pixel difference, and the per-image time of both paths. ``regions.ROI_HEADROOM`` holds, per
filter, the smallest headroom whose sharpness stays within ``SHARPNESS_TOLERANCE`` on every set.

The region decoder must be built (``decoder_problem("jpeg-roi")``). Timings are one process, one
thread, after a warm-up pass; the machine's other load shows in them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from loader_service.decode import decoders
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.transforms import Recipe, load_bytes_into, transform_into
from loader_service.tools.synthetic_photos import render_photo
from protocol.pixels import geometry, regions
from protocol.pixels.regions import ROI_HEADROOM, SHARPNESS_TOLERANCE
from protocol.pixels.render import decode_bytes

HEADROOMS = (1.0, 1.5, 2.0, 3.0, 4.0)


@dataclass(frozen=True)
class Row:
    images: str
    augment: str
    interpolation: str
    headroom: float
    scaled_share: float
    sharpness_ratio: float
    mean_abs_diff: float
    ms_region: float
    ms_full: float

    @property
    def within(self) -> bool:
        return abs(self.sharpness_ratio - 1) <= SHARPNESS_TOLERANCE


def synthetic_set(height: int, width: int, count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    encoded = []
    for i in range(count):
        ok, data = cv2.imencode(
            ".jpg", render_photo(rng, i % 8, width, height), [cv2.IMWRITE_JPEG_QUALITY, 90]
        )
        assert ok
        encoded.append(data.tobytes())
    return encoded


def folder_set(folder: Path) -> list[bytes]:
    """Every image OpenCV reads in ``folder``, re-encoded as JPEG quality 90 (the region decoder's case)."""
    encoded = []
    for path in sorted(folder.iterdir()):
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None or min(image.shape[:2]) < 64:
            continue
        ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        if ok:
            encoded.append(data.tobytes())
    return encoded


@contextmanager
def headroom(interpolation: str, value: float) -> Iterator[None]:
    """Run the region path with another headroom for one filter (this study's only knob)."""
    kept = ROI_HEADROOM[interpolation]
    ROI_HEADROOM[interpolation] = value
    try:
        yield
    finally:
        ROI_HEADROOM[interpolation] = kept


def sharpness(chw: np.ndarray) -> float:
    return float(np.abs(np.diff(chw.astype(np.int16), axis=2)).mean())


def _scaled(data: bytes, recipe: Recipe, seed: int, size: int) -> bool:
    height, width = decode_bytes(data).shape[:2]
    if recipe.augment == "train":
        crop = geometry.random_resized_crop_params(np.random.default_rng(seed), height, width)
    else:
        crop = regions.eval_region(height, width, size)
    return regions.roi_scale(crop, size, ROI_HEADROOM[recipe.interpolation]) < 8


def measure(label: str, images: Sequence[bytes], recipe: Recipe, value: float, size: int) -> Row:
    full_recipe = Recipe(recipe.augment, recipe.interpolation, roi=False)
    out_region = np.empty((3, size, size), np.uint8)
    out_full = np.empty((3, size, size), np.uint8)
    sharp_region, sharp_full, diffs, scaled = [], [], [], 0
    region_s = full_s = 0.0
    with headroom(recipe.interpolation, value):
        for seed, data in enumerate(images):
            scaled += _scaled(data, recipe, seed, size)
            start = time.perf_counter()
            load_bytes_into(data, out_region, recipe, np.random.default_rng(seed))
            middle = time.perf_counter()
            transform_into(decode_bytes(data), out_full, full_recipe, np.random.default_rng(seed))
            full_s += time.perf_counter() - middle
            region_s += middle - start
            sharp_region.append(sharpness(out_region))
            sharp_full.append(sharpness(out_full))
            diffs.append(float(np.abs(out_region.astype(np.int16) - out_full).mean()))
    n = len(images)
    return Row(
        label,
        recipe.augment,
        recipe.interpolation,
        value,
        scaled / n,
        float(np.mean(sharp_region) / np.mean(sharp_full)),
        float(np.mean(diffs)),
        region_s / n * 1e3,
        full_s / n * 1e3,
    )


def run(sets: dict[str, list[bytes]], size: int, headrooms: Sequence[float] = HEADROOMS) -> list[Row]:
    cv2.setNumThreads(1)
    for interpolation in INTERPOLATIONS:
        geometry.prepare(interpolation)
    rows = []
    for label, images in sets.items():
        measure(label, images[:8], Recipe("train", INTERPOLATIONS[0], roi=True), 3.0, size)  # warm-up
        for augment in ("train", "eval"):
            for interpolation in INTERPOLATIONS:
                for value in headrooms:
                    row = measure(label, images, Recipe(augment, interpolation, roi=True), value, size)
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def format_row(r: Row) -> str:
    mark = "ok" if r.within else "--"
    return (
        f"{r.images:>14} {r.augment:>5} {r.interpolation:>18} x{r.headroom:<4} scaled {r.scaled_share:5.0%}  "
        f"sharpness {r.sharpness_ratio:6.3f} {mark}  |diff| {r.mean_abs_diff:5.2f}  "
        f"region {r.ms_region:6.2f} ms  full {r.ms_full:6.2f} ms  gain {r.ms_full / r.ms_region:5.2f}x"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dct_scaling", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--count", type=int, default=40, help="synthetic photos per size")
    parser.add_argument("--size", type=int, default=224, help="output side S")
    parser.add_argument("--sizes", default="375x500,1200x1600", help="synthetic sets, HEIGHTxWIDTH,...")
    parser.add_argument("--headrooms", default=",".join(map(str, HEADROOMS)), help="headrooms to try")
    parser.add_argument("--images", type=Path, help="a folder of your own images, added as one more set")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    problem = decoders.decoder_problem("jpeg-roi")
    if problem:
        raise SystemExit(problem)
    sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",") if item]
    sets = {f"synthetic {w}x{h}": synthetic_set(h, w, args.count, seed=h) for h, w in sizes}
    if args.images:
        sets[f"folder ({args.images.name})"] = folder_set(args.images)
    print(f"tolerance: sharpness within {SHARPNESS_TOLERANCE:.0%} of a full decode's; chosen: {ROI_HEADROOM}")
    rows = run(sets, args.size, [float(v) for v in args.headrooms.split(",")])
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
