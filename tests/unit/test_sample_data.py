"""Tests for the photo-like sample dataset generator."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from numpy.typing import NDArray

from loader_service.tools.sample_data import (
    SampleDatasetSummary,
    make_sample_dataset,
    render_photo,
)

MARKER = ".dataferry-sample.json"
# JPEG cost at q90 4:2:0, in bytes per pixel. The generator measures 0.36-0.73
# (mean 0.56) over 1000 images; flat colour gives ~0.02. Uniform RGB noise gives
# only ~0.92 with 4:2:0 (~1.9 with 4:4:4), so the upper bound sits below that
# and the spectral slope, not file size, is the main guard against noise.
BYTES_PER_PIXEL_BAND = (0.25, 0.85)
SLOPE_BAND = (-3.2, -1.6)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _jpeg_bytes_per_pixel(image: NDArray[np.uint8]) -> float:
    params = [
        cv2.IMWRITE_JPEG_QUALITY,
        90,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
    ]
    ok, buffer = cv2.imencode(".jpg", image, params)
    assert ok
    return int(buffer.size) / (int(image.shape[0]) * int(image.shape[1]))


def _spectral_slope(image: NDArray[np.uint8]) -> float:
    """Log-log slope of the radially averaged power spectrum of the luma."""
    gray = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(np.float64)
    n = min(gray.shape)
    top, left = (gray.shape[0] - n) // 2, (gray.shape[1] - n) // 2
    gray = gray[top : top + n, left : left + n]
    window = np.outer(np.hanning(n), np.hanning(n))
    power = np.abs(np.fft.fftshift(np.fft.fft2((gray - gray.mean()) * window))) ** 2
    yy, xx = np.indices(power.shape)
    radius = (np.hypot(yy - n // 2, xx - n // 2) / n).ravel()
    edges = np.geomspace(4.0 / n, 0.25, 20)
    which = np.digitize(radius, edges)
    freqs, powers = [], []
    for i in range(1, edges.size):
        selected = which == i
        if selected.any():
            freqs.append(radius[selected].mean())
            powers.append(power.ravel()[selected].mean())
    return float(np.polyfit(np.log(freqs), np.log(powers), 1)[0])


def _decoded_images(root: Path) -> list[NDArray[np.uint8]]:
    images = []
    for path in sorted(root.glob("class_*/img_*.jpg")):
        image = cv2.imdecode(np.fromfile(path, dtype=np.uint8), cv2.IMREAD_COLOR)
        assert image is not None, path
        images.append(np.asarray(image, dtype=np.uint8))
    return images


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> SampleDatasetSummary:
    """Shared tree for read-only checks, to keep the suite fast."""
    return make_sample_dataset(tmp_path_factory.mktemp("shared") / "ds", classes=4, per_class=3, seed=7)


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    first = make_sample_dataset(tmp_path / "a", classes=2, per_class=2, seed=3)
    second = make_sample_dataset(tmp_path / "b", classes=2, per_class=2, seed=3)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert first.total_bytes == second.total_bytes


def test_different_seed_gives_different_images(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path / "a", classes=1, per_class=2, seed=0)
    make_sample_dataset(tmp_path / "b", classes=1, per_class=2, seed=1)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a["class_000/img_00000.jpg"] != b["class_000/img_00000.jpg"]


def test_layout_counts_and_summary(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    calls: list[tuple[int, int]] = []
    summary = make_sample_dataset(root, classes=3, per_class=2, progress=lambda d, t: calls.append((d, t)))
    expected = {f"class_{c:03d}/img_{i:05d}.jpg" for c in range(3) for i in range(2)}
    files = _files(root)
    assert set(files) == expected | {MARKER}
    assert calls == [(n, 6) for n in range(1, 7)]
    assert summary.root == root
    assert (summary.classes, summary.images) == (3, 6)
    assert summary.total_bytes == sum(len(data) for name, data in files.items() if name != MARKER)
    images = _decoded_images(root)
    assert summary.mean_width == pytest.approx(np.mean([im.shape[1] for im in images]))
    assert summary.mean_height == pytest.approx(np.mean([im.shape[0] for im in images]))
    assert json.loads(files[MARKER])["seed"] == 0


def test_image_sizes_vary_like_imagenet(small_dataset: SampleDatasetSummary) -> None:
    shapes = {im.shape for im in _decoded_images(small_dataset.root)}
    assert len(shapes) > 1
    assert all(im_shape[2] == 3 and 150 <= max(im_shape[:2]) <= 1200 for im_shape in shapes)


def test_marker_short_circuits_regeneration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ds"
    first = make_sample_dataset(root, classes=2, per_class=2)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    def fail(*_: object) -> None:
        raise AssertionError("must not render when the marker matches")

    monkeypatch.setattr("loader_service.tools.sample_data.render_photo", fail)
    calls: list[tuple[int, int]] = []
    second = make_sample_dataset(root, classes=2, per_class=2, progress=lambda d, t: calls.append((d, t)))
    assert second == first
    assert calls == []
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_refuses_foreign_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        make_sample_dataset(tmp_path, classes=1, per_class=1)
    assert _files(tmp_path) == {"notes.txt": b"mine"}


def test_empty_existing_directory_is_used(tmp_path: Path) -> None:
    summary = make_sample_dataset(tmp_path, classes=1, per_class=1)
    assert summary.images == 1
    assert (tmp_path / "class_000" / "img_00000.jpg").is_file()


@pytest.mark.parametrize(("per_class", "seed", "quality"), [(2, 1, 90), (3, 0, 90), (2, 0, 80)])
def test_refuses_tree_made_with_other_parameters(
    tmp_path: Path, per_class: int, seed: int, quality: int
) -> None:
    make_sample_dataset(tmp_path, classes=1, per_class=2)
    before = _files(tmp_path)
    with pytest.raises(ValueError, match="marker"):
        make_sample_dataset(tmp_path, classes=1, per_class=per_class, seed=seed, quality=quality)
    assert _files(tmp_path) == before


def test_refuses_tree_edited_after_generation(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, classes=1, per_class=2)
    (tmp_path / "class_000" / "img_00001.jpg").unlink()
    with pytest.raises(ValueError):
        make_sample_dataset(tmp_path, classes=1, per_class=2)


def test_damaged_marker_is_not_trusted(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, classes=1, per_class=1)
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(ValueError, match="marker"):
        make_sample_dataset(tmp_path, classes=1, per_class=1)


def test_interrupted_run_leaves_only_complete_files(tmp_path: Path) -> None:
    def interrupt(done: int, _total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_sample_dataset(tmp_path, classes=2, per_class=2, progress=interrupt)
    assert set(_files(tmp_path)) == {"class_000/img_00000.jpg", "class_000/img_00001.jpg"}
    assert all(image is not None for image in _decoded_images(tmp_path))
    with pytest.raises(ValueError, match="interrupted"):
        make_sample_dataset(tmp_path, classes=2, per_class=2)


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file.jpg"
    target.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        make_sample_dataset(target, classes=1, per_class=1)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 1, 0, 90), "classes"),
        ((1, 0, 0, 90), "per_class"),
        ((1, 1, 0, 0), "quality"),
        ((1, 1, 0, 101), "quality"),
        ((1, 1, -1, 90), "seed"),
    ],
)
def test_argument_validation_names_the_argument(
    tmp_path: Path, args: tuple[int, int, int, int], name: str
) -> None:
    classes, per_class, seed, quality = args
    with pytest.raises(ValueError, match=f"^{name} must"):
        make_sample_dataset(tmp_path / "ds", classes=classes, per_class=per_class, seed=seed, quality=quality)
    assert not (tmp_path / "ds").exists()


def test_cv2_thread_count_is_restored(tmp_path: Path) -> None:
    before = cv2.getNumThreads()
    make_sample_dataset(tmp_path, classes=1, per_class=1)
    assert cv2.getNumThreads() == before


def test_render_photo_shape_dtype_and_determinism() -> None:
    first = render_photo(np.random.default_rng(5), 2, 320, 240)
    second = render_photo(np.random.default_rng(5), 2, 320, 240)
    assert first.shape == (240, 320, 3)
    assert first.dtype == np.uint8
    assert np.array_equal(first, second)
    assert first.std() > 10.0


def test_render_photo_rejects_tiny_sizes() -> None:
    with pytest.raises(ValueError, match="width and height"):
        render_photo(np.random.default_rng(0), 0, 4, 100)


def test_realism_band_excludes_flat_colour_and_white_noise() -> None:
    """Guards the guard: the bands must reject the unrealistic extremes."""
    low, high = BYTES_PER_PIXEL_BAND
    flat = np.full((375, 500, 3), (40, 120, 200), dtype=np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8)
    assert _jpeg_bytes_per_pixel(flat) < low
    assert _jpeg_bytes_per_pixel(noise) > high
    assert not SLOPE_BAND[0] <= _spectral_slope(noise) <= SLOPE_BAND[1]


def test_generated_jpegs_have_photo_like_size(small_dataset: SampleDatasetSummary) -> None:
    low, high = BYTES_PER_PIXEL_BAND
    paths = sorted(small_dataset.root.glob("class_*/img_*.jpg"))
    pixels = [image.shape[0] * image.shape[1] for image in _decoded_images(small_dataset.root)]
    for path, count in zip(paths, pixels, strict=True):
        bytes_per_pixel = path.stat().st_size / count
        assert low <= bytes_per_pixel <= high, (path, bytes_per_pixel)
    assert 0.4 <= small_dataset.total_bytes / sum(pixels) <= 0.75


def test_generated_images_have_natural_power_spectrum(small_dataset: SampleDatasetSummary) -> None:
    low, high = SLOPE_BAND
    slopes = [_spectral_slope(image) for image in _decoded_images(small_dataset.root)]
    assert all(low <= slope <= high for slope in slopes), slopes


def test_classes_have_distinct_character() -> None:
    """Mean colour should separate classes more than it varies within one."""
    means = np.array(
        [
            [
                render_photo(np.random.default_rng([c, i]), c, 160, 120).reshape(-1, 3).mean(axis=0)
                for i in range(6)
            ]
            for c in range(4)
        ]
    )
    within = means.std(axis=1).mean()
    between = means.mean(axis=1).std(axis=0).mean()
    assert between > 0.5 * within
