"""The resize filters (``--interpolation``) and eval's region decoding (NOTE [ Eval regions ]).

Equality is the strong check: each filter must be exactly the library call it names, and an eval
output decoded from its region alone exactly the full decode's wherever the region is not scaled.
"""

from __future__ import annotations

import math
import shutil
import sysconfig
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from torch.nn.functional import interpolate

from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.transforms import Recipe, load_bytes_into
from loader_service.tools.sample_data import render_photo
from protocol.pixels import geometry, regions
from protocol.pixels.geometry import Crop, eval_geometry, resize
from protocol.pixels.regions import ROI_HEADROOM, SHARPNESS_TOLERANCE, eval_region, roi_scale
from tests.helpers import CountingDecoder

jc = regions._jpegcrop
resample = geometry._resample
needs_roi = pytest.mark.skipif(jc is None, reason="the region decoder is not built here")
SHAPES = [(375, 500), (500, 375), (97, 130), (240, 320), (231, 1000), (1000, 230), (64, 64), (300, 301)]


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    return render_photo(np.random.default_rng(seed), seed % 5, width, height)


def jpeg(height: int, width: int, seed: int = 0) -> bytes:
    ok, buf = cv2.imencode(".jpg", photo(height, width, seed), [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes()


def run(data: bytes, recipe: Recipe, size: int, seed: int = 0) -> np.ndarray:
    out = np.empty((3, size, size), np.uint8)
    load_bytes_into(data, out, recipe, np.random.default_rng(seed))
    return out


# --- the filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("height", "width"), [(375, 500), (50, 40), (224, 224)])
def test_each_filter_is_the_library_call_it_names(height: int, width: int) -> None:
    image = photo(height, width)
    geometry.prepare("bilinear-antialias")
    tensor = torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0).contiguous()
    torch_aa = interpolate(tensor, size=(96, 128), mode="bilinear", antialias=True, align_corners=False)
    expected = {
        "bilinear-antialias": torch_aa[0].permute(1, 2, 0).numpy(),
        "bilinear": cv2.resize(image, (128, 96), interpolation=cv2.INTER_LINEAR),
        "area": cv2.resize(
            image, (128, 96), interpolation=cv2.INTER_AREA if height * width > 96 * 128 else cv2.INTER_LINEAR
        ),
    }
    for name in INTERPOLATIONS:
        assert np.array_equal(resize(image, 128, 96, name), expected[name]), name


def test_built_wherever_a_c_compiler_exists() -> None:
    # The install treats it as optional, so a broken build would only show as torch in every worker.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): torch's resize is what runs")
    assert resample is not None


def torch_antialias(image: np.ndarray, height: int, width: int) -> np.ndarray:
    tensor = torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0)
    out = interpolate(tensor, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


@pytest.mark.skipif(resample is None, reason="_resample is not built here")
def test_the_c_resize_is_torchs_to_the_last_bit() -> None:
    # Random sizes shrink, enlarge, keep one side or both; noise and smooth ramps both.
    assert resample is not None
    rng = np.random.default_rng(0)
    for case in range(300):
        h, w, oh, ow = (int(v) for v in rng.integers(1, 600, size=4))
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if case % 2:
            image = cv2.GaussianBlur(image, (0, 0), 3)
        if case % 7 == 0:
            oh = h
        out = np.empty((oh, ow, 3), np.uint8)
        resample.resize(image, h, w, out, oh, ow)
        assert np.array_equal(out, torch_antialias(image, oh, ow)), (h, w, oh, ow)


@pytest.mark.skipif(resample is None, reason="_resample is not built here")
def test_a_window_of_the_c_resize_is_that_part_of_the_whole() -> None:
    assert resample is not None
    rng = np.random.default_rng(1)
    for _ in range(100):
        h, w, oh, ow = (int(v) for v in rng.integers(2, 500, size=4))
        image = cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (0, 0), 2)
        top, left = int(rng.integers(0, oh)), int(rng.integers(0, ow))
        rows, cols = int(rng.integers(1, oh - top + 1)), int(rng.integers(1, ow - left + 1))
        window = np.empty((rows, cols, 3), np.uint8)
        resample.resize(image, h, w, window, oh, ow, top, left, rows, cols)
        whole = torch_antialias(image, oh, ow)
        assert np.array_equal(window, whole[top : top + rows, left : left + cols]), (h, w, oh, ow, top, left)


@pytest.mark.skipif(resample is None, reason="_resample is not built here")
def test_the_c_resize_refuses_buffers_that_do_not_match() -> None:
    assert resample is not None
    with pytest.raises(ValueError, match="buffer sizes"):
        resample.resize(bytes(30), 4, 4, bytearray(12), 2, 2)
    with pytest.raises(ValueError, match="sides"):
        resample.resize(bytes(0), 0, 4, bytearray(12), 2, 2)
    # As wide as OpenCV decodes: a panorama is not a bad sample.
    wide = np.zeros((2, 70000, 3), np.uint8)
    out = np.empty((1, 100, 3), np.uint8)
    resample.resize(wide, 2, 70000, out, 1, 100)
    assert not out.any()
    with pytest.raises(TypeError):
        resample.resize(bytes(48), 4, 4, bytes(12), 2, 2)  # a read-only destination
    with pytest.raises(ValueError, match="window"):
        resample.resize(bytes(48), 4, 4, bytearray(12), 2, 2, 1, 1, 2, 2)


def test_without_the_c_resize_torch_does_it(monkeypatch: pytest.MonkeyPatch) -> None:
    image = photo(120, 90)
    expected = torch_antialias(image, 40, 50)
    monkeypatch.setattr(geometry, "_resample", None)
    geometry.prepare("bilinear-antialias")
    assert np.array_equal(resize(image, 50, 40, "bilinear-antialias"), expected)


def test_the_filters_give_different_pixels() -> None:
    # Guards the plumbing: a recipe whose filter were ignored would give one output for all three.
    data = jpeg(375, 500)
    outputs = {name: run(data, Recipe("train", name), 64, seed=3) for name in INTERPOLATIONS}
    for a in INTERPOLATIONS:
        for b in INTERPOLATIONS:
            if a < b:
                assert not np.array_equal(outputs[a], outputs[b]), (a, b)


# --- eval regions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("height", "width"), SHAPES)
def test_eval_region_covers_the_centre_crop(height: int, width: int) -> None:
    for size in (32, 64, 224):
        new_h, new_w, c = eval_geometry(height, width, size)
        for num in (8, 4, 2, 1):
            r = eval_region(height, width, size, num)
            assert r.top >= 0 and r.top + r.height <= height and r.left >= 0 and r.left + r.width <= width
            # The crop mapped back to the image, with at least one scale factor of margin.
            sy, sx = height / new_h, width / new_w
            assert r.top <= max(0, c.top * sy - sy) and r.top + r.height >= min(
                height, (c.top + size) * sy + sy
            )
            assert r.left <= max(0, c.left * sx - sx) and r.left + r.width >= min(
                width, (c.left + size) * sx + sx
            )


@needs_roi
@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_unscaled_eval_regions_equal_the_full_decode(
    interpolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert jc is not None
    counting = CountingDecoder(jc)
    monkeypatch.setattr(regions, "_jpegcrop", counting)
    geometry.prepare(interpolation)
    compared = 0
    for seed, (height, width) in enumerate(SHAPES):
        data = jpeg(height, width, seed)
        for size in (32, 64, 224):
            r = eval_region(height, width, size)
            if roi_scale(r, size, ROI_HEADROOM[interpolation]) != 8:
                continue
            region = run(data, Recipe("eval", interpolation, roi=True), size)
            full = run(data, Recipe("eval", interpolation, roi=False), size)
            assert np.array_equal(region, full), (height, width, size)
            compared += 1
    assert compared >= 15
    assert counting.calls == compared, "every eval went through the region decoder"


@needs_roi
@pytest.mark.parametrize("interpolation", [i for i in INTERPOLATIONS if math.isfinite(ROI_HEADROOM[i])])
def test_scaled_eval_regions_keep_the_full_decodes_sharpness(interpolation: str) -> None:
    geometry.prepare(interpolation)
    sharp_region, sharp_full, diffs = [], [], []
    for seed in range(6):
        data = jpeg(1200, 1600, seed)
        size = 128  # the 1050-pixel centre is over 4x 128: decoded at 1/2 scale or less
        assert roi_scale(eval_region(1200, 1600, size), size, ROI_HEADROOM[interpolation]) < 8
        region = run(data, Recipe("eval", interpolation, roi=True), size).astype(int)
        full = run(data, Recipe("eval", interpolation, roi=False), size).astype(int)
        sharp_region.append(np.abs(np.diff(region, axis=2)).mean())
        sharp_full.append(np.abs(np.diff(full, axis=2)).mean())
        diffs.append(np.abs(region - full).mean())
        assert diffs[-1] > 0, "scaled: a full decode's pixels would mean the region path did not run"
    # Same place in the image: a shifted or mis-cut region would differ by far more than scaling does.
    assert np.mean(diffs) < 4
    assert abs(np.mean(sharp_region) / np.mean(sharp_full) - 1) <= SHARPNESS_TOLERANCE


def test_plain_bilinear_never_scales() -> None:
    assert roi_scale(Crop(0, 0, 6000, 8000), 32, ROI_HEADROOM["bilinear"]) == 8


@needs_roi
def test_a_refused_region_falls_back_to_the_full_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    data = jpeg(240, 320)
    expected = run(data, Recipe("eval", roi=False), 64)

    def refuse(*args: Any) -> Any:
        raise ValueError("refused")

    monkeypatch.setattr(regions._jpegcrop, "decode", refuse)
    assert np.array_equal(run(data, Recipe("eval", roi=True), 64), expected)
