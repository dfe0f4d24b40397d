"""Write a synthetic ImageFolder dataset of photo-like JPEGs for demos, benchmarks and tests.

The images come from ``synthetic_photos.render_photo``; this module decides their sizes, encodes
them, lays them out as ``class_NNN/img_NNNNN.jpg`` and writes each file atomically. The same
parameters give byte-identical trees, and a marker file written last lets a later call reuse a
complete tree instead of rendering it again.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from loader_service.tools.synthetic_photos import ByteImage, render_photo

__all__ = ["SampleDatasetSummary", "make_sample_dataset", "progress_printer", "render_photo"]

MARKER_NAME = ".dataferry-sample.json"
# Bump whenever rendering (synthetic_photos) or the sizes and encoding chosen here change: a
# cached tree from an older generator must not be mistaken for the byte-identical output the
# seed promises.
GENERATOR_VERSION = 1
_MARKER_FORMAT = "dataferry-sample"

# (width, height) aspect ratios and how often ImageNet-like data uses them.
_ASPECTS: tuple[tuple[float, float], ...] = ((4, 3), (3, 2), (3, 4), (1, 1), (16, 9))
_ASPECT_PROBS = np.array([0.55, 0.15, 0.12, 0.06, 0.12])


@dataclass(frozen=True)
class SampleDatasetSummary:
    """What a generated (or reused) sample tree contains, for reporting."""

    root: Path
    classes: int
    images: int
    total_bytes: int
    mean_width: float
    mean_height: float


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def progress_printer(label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback that prints about twenty lines over a run."""

    def report(done: int, total: int) -> None:
        step = max(1, total // 20)
        if done == total or done % step == 0:
            print(f"{label}: {done}/{total}", file=sys.stderr, flush=True)

    return report


def make_sample_dataset(
    root: Path,
    *,
    classes: int = 10,
    per_class: int = 100,
    seed: int = 0,
    quality: int = 90,
    progress: Callable[[int, int], None] | None = None,
    processes: int = 1,
) -> SampleDatasetSummary:
    """Create (or reuse) an ImageFolder tree of photo-like JPEGs under ``root``.

    A matching marker short-circuits regeneration so demos are fast the second
    time; a non-empty directory without one is refused rather than touched,
    because it may hold the user's own files. ``processes`` > 1 renders in that many processes,
    with the same bytes.
    """
    _validate_args(classes, per_class, seed, quality)
    root = Path(root)
    params = _marker_params(classes, per_class, seed, quality)
    cached = _reusable_summary(root, params)
    if cached is not None:
        return cached
    _ensure_empty_root(root)
    return _generate(root, params, progress, processes)


# --------------------------------------------------------------------------
# Dataset bookkeeping
# --------------------------------------------------------------------------


def _validate_args(classes: int, per_class: int, seed: int, quality: int) -> None:
    """Fail early with the argument's name; a bad value deep inside is opaque."""
    if classes < 1:
        raise ValueError(f"classes must be >= 1, got {classes}")
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (numpy SeedSequence), got {seed}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")


def _marker_params(classes: int, per_class: int, seed: int, quality: int) -> dict[str, int | str]:
    """Everything that determines the bytes, so a marker match implies reuse is safe."""
    return {
        "format": _MARKER_FORMAT,
        "generator_version": GENERATOR_VERSION,
        "classes": classes,
        "per_class": per_class,
        "seed": seed,
        "quality": quality,
    }


def _relative_image_paths(classes: int, per_class: int) -> Iterator[tuple[int, int, str]]:
    """Single source of truth for the layout shared by writer and checker."""
    for class_id in range(classes):
        for image_no in range(per_class):
            yield class_id, image_no, f"class_{class_id:03d}/img_{image_no:05d}.jpg"


def _read_marker(root: Path) -> dict[str, Any] | None:
    """Treat an unreadable marker like a missing one: refuse, never guess."""
    try:
        data = json.loads((root / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _reusable_summary(root: Path, params: dict[str, int | str]) -> SampleDatasetSummary | None:
    """Reuse only a complete tree of our own making with identical parameters."""
    if not root.is_dir():
        return None
    marker = _read_marker(root)
    if marker is None or any(marker.get(k) != v for k, v in params.items()):
        return None
    try:
        summary = SampleDatasetSummary(
            root=root,
            classes=int(marker["classes"]),
            images=int(marker["images"]),
            total_bytes=int(marker["total_bytes"]),
            mean_width=float(marker["mean_width"]),
            mean_height=float(marker["mean_height"]),
        )
    except (KeyError, TypeError, ValueError):
        return None  # a damaged marker proves nothing about the tree
    return summary if _holds_exactly(root, params, summary.total_bytes) else None


def _holds_exactly(root: Path, params: dict[str, int | str], total_bytes: int) -> bool:
    """Catch trees edited or truncated after the marker was written."""
    expected = {rel for _, _, rel in _relative_image_paths(int(params["classes"]), int(params["per_class"]))}
    found: set[str] = set()
    size = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if rel == MARKER_NAME:
                continue
            found.add(rel)
            size += path.stat().st_size
    return found == expected and size == total_bytes


def _ensure_empty_root(root: Path) -> None:
    """Never write into (or delete from) a directory we did not create."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"sample dataset root {root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()):
        raise ValueError(
            f"sample dataset root {root} is not empty and has no matching "
            f"{MARKER_NAME} marker (foreign files, different parameters, or an "
            "interrupted run); choose another directory or empty it yourself"
        )
    root.mkdir(parents=True, exist_ok=True)


def _write_atomic(path: Path, data: bytes) -> None:
    """A crash must never leave a truncated file under its final name."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _encode_jpeg(image: ByteImage, quality: int) -> bytes:
    """Pin 4:2:0 explicitly so file sizes do not depend on codec defaults."""
    params = [
        cv2.IMWRITE_JPEG_QUALITY,
        quality,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
    ]
    ok, buffer = cv2.imencode(".jpg", image, params)
    if not ok:
        raise RuntimeError("cv2.imencode failed to encode a JPEG")
    return bytes(buffer.tobytes())


def _generate(
    root: Path, params: dict[str, int | str], progress: Callable[[int, int], None] | None, processes: int
) -> SampleDatasetSummary:
    """Each image depends only on (seed, class, number), so several processes give the same bytes."""
    classes, per_class = int(params["classes"]), int(params["per_class"])
    seed, quality = int(params["seed"]), int(params["quality"])
    total = classes * per_class
    done = total_bytes = sum_w = sum_h = 0
    jobs = [(seed, quality, c, n, rel) for c, n, rel in _relative_image_paths(classes, per_class)]
    with _renderer(processes) as render:
        for rel, data, width, height in render(_render_one, jobs):
            (root / rel).parent.mkdir(exist_ok=True)
            _write_atomic(root / rel, data)
            done, total_bytes = done + 1, total_bytes + len(data)
            sum_w, sum_h = sum_w + width, sum_h + height
            if progress is not None:
                progress(done, total)
    summary = SampleDatasetSummary(root, classes, total, total_bytes, sum_w / total, sum_h / total)
    _write_marker(root, params, summary)
    return summary


Job = tuple[int, int, int, int, str]
"""(seed, quality, class, number, relative path) of one image."""
Rendered = tuple[str, bytes, int, int]
Mapper = Callable[[Callable[[Job], Rendered], list[Job]], Iterator[Rendered]]


@contextmanager
def _renderer(processes: int) -> Iterator[Mapper]:
    """``map`` in this process for 1, else an ordered ``map`` over ``processes`` processes."""
    if processes <= 1:
        yield map
        return
    # An executor, not a Pool: a worker that cannot start is an error here, not a respawn loop.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=spawn) as pool:
        yield lambda function, jobs: pool.map(function, jobs, chunksize=16)


def _render_one(job: Job) -> Rendered:
    """One image, single-threaded: OpenCV's own threads would make workers fight over cores."""
    seed, quality, class_id, image_no, rel = job
    previous_threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        rng = np.random.default_rng(np.random.SeedSequence([seed, class_id, image_no]))
        width, height = _sample_size(rng)
        return rel, _encode_jpeg(render_photo(rng, class_id, width, height), quality), width, height
    finally:
        cv2.setNumThreads(previous_threads)


def _write_marker(root: Path, params: dict[str, int | str], summary: SampleDatasetSummary) -> None:
    """Written last, so its presence means every image is complete."""
    record: dict[str, Any] = dict(params)
    record.update(
        images=summary.images,
        total_bytes=summary.total_bytes,
        mean_width=summary.mean_width,
        mean_height=summary.mean_height,
    )
    _write_atomic(root / MARKER_NAME, json.dumps(record, indent=2).encode("utf-8"))


def _sample_size(rng: np.random.Generator) -> tuple[int, int]:
    """ImageNet-like sizes: mostly 500px-long landscape, a spread, a few big ones."""
    aspect_w, aspect_h = _ASPECTS[int(rng.choice(len(_ASPECTS), p=_ASPECT_PROBS))]
    roll = rng.random()
    if roll < 0.5:
        long_side = 500.0
    elif roll < 0.96:
        long_side = float(np.clip(rng.lognormal(math.log(480.0), 0.25), 300.0, 800.0))
    else:
        long_side = rng.uniform(800.0, 1200.0)
    scale = long_side / max(aspect_w, aspect_h)
    return max(8, round(aspect_w * scale)), max(8, round(aspect_h * scale))
