"""The region decoder (protocol/pixels/_jpegcrop.c) and the train path built on it, on real JPEGs.

The strongest check is equality: at full scale the region decoder must give exactly OpenCV's pixels,
and ``load_into`` with it exactly what a full decode + crop gives, for the same per-sample seed.
"""

from __future__ import annotations

import io
import sysconfig
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from loader_service.config import ConfigError, load_config
from loader_service.decode import decoders
from loader_service.decode.decoders import roi_decoder_version
from loader_service.decode.transforms import Recipe, load_into
from loader_service.tools.sample_data import render_photo
from protocol.pixels import DecodeError, regions
from protocol.pixels.geometry import Crop, random_resized_crop_params
from protocol.pixels.regions import roi_scale
from tests.helpers import CountingDecoder

jc = regions._jpegcrop
needs_roi = pytest.mark.skipif(jc is None, reason="the region decoder is not built here")


def _headers_present() -> bool:
    dirs = [sysconfig.get_paths()["include"], "/usr/include", "/usr/local/include"]
    return any((Path(d) / "jpeglib.h").exists() for d in dirs)


def test_built_wherever_libjpeg_headers_exist() -> None:
    # Catches a broken build: the install makes it optional, so nothing else would notice.
    if not _headers_present():
        pytest.skip("no jpeglib.h on this machine: the OpenCV fallback is what runs")
    version = roi_decoder_version()
    assert version is not None and version.split(".")[0] in ("1", "2", "3")


def photo_jpeg(
    height: int, width: int, seed: int = 0, quality: int = 90, flags: tuple[int, ...] = ()
) -> bytes:
    bgr = render_photo(np.random.default_rng(seed), seed % 5, width, height)
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality, *flags])
    assert ok
    return buf.tobytes()


JPEG_KINDS = {
    "420": (),
    "444": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444),
    "422": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422),
    "progressive": (cv2.IMWRITE_JPEG_PROGRESSIVE, 1),
}


def full_decode(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)


def region(data: bytes, c: Crop, num: int) -> np.ndarray:
    assert jc is not None
    pixels, rows, row_width, skip = jc.decode(data, c.top, c.left, c.height, c.width, num)
    cols = -(-(c.left + c.width) * num // 8) - c.left * num // 8
    assert rows == -(-(c.top + c.height) * num // 8) - c.top * num // 8
    assert skip >= 0 and skip + cols <= row_width
    return np.frombuffer(pixels, np.uint8).reshape(rows, row_width, 3)[:, skip : skip + cols]


def random_regions(rng: np.random.Generator, height: int, width: int, n: int) -> list[Crop]:
    crops = [Crop(0, 0, height, width), Crop(0, 0, 1, 1), Crop(height - 1, width - 1, 1, 1)]
    crops.append(Crop(16, 16, min(32, height - 16), min(32, width - 16)))  # on iMCU boundaries
    for _ in range(n):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        crops.append(Crop(int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return crops


@needs_roi
@pytest.mark.parametrize("kind", sorted(JPEG_KINDS))
def test_full_scale_region_equals_opencv(kind: str) -> None:
    data = photo_jpeg(203, 317, seed=3, flags=JPEG_KINDS[kind])
    full = full_decode(data)
    for c in random_regions(np.random.default_rng(1), *full.shape[:2], n=40):
        got = region(data, c, 8)
        want = full[c.top : c.top + c.height, c.left : c.left + c.width]
        assert np.array_equal(got, want), (kind, c)


@needs_roi
def test_greyscale_jpeg_comes_out_as_three_equal_channels() -> None:
    grey = cv2.cvtColor(render_photo(np.random.default_rng(2), 1, 120, 90), cv2.COLOR_BGR2GRAY)
    data = cv2.imencode(".jpg", grey)[1].tobytes()
    assert jc is not None and jc.header(data) == (90, 120, 1, 1)
    c = Crop(10, 20, 50, 60)
    assert np.array_equal(region(data, c, 8), full_decode(data)[10:60, 20:80])


@needs_roi
@pytest.mark.parametrize("num", [4, 2, 1])
def test_scaled_region_is_the_area_shrunk_region(num: int) -> None:
    data = photo_jpeg(480, 640, seed=4)
    full = full_decode(data)
    step = 8 // num
    for c in random_regions(np.random.default_rng(num), 480, 640, n=20)[4:]:
        if min(c.height, c.width) * num < 64:
            continue  # a few scaled pixels say little about equivalence
        got = region(data, c, num)
        # The full-size pixels the scaled ones stand for, whole blocks of step x step only.
        y0, x0 = c.top * num // 8, c.left * num // 8
        rows, cols = min(got.shape[0], 480 // step - y0), min(got.shape[1], 640 // step - x0)
        source = full[y0 * step : (y0 + rows) * step, x0 * step : (x0 + cols) * step]
        want = cv2.resize(source, (cols, rows), interpolation=cv2.INTER_AREA)
        # DCT scaling and area averaging are different low-pass filters of the same pixels
        # (measured: mean absolute difference about 0.7 to 1.0 on this photo).
        assert np.abs(got[:rows, :cols].astype(int) - want).mean() < 2.0, c
        assert abs(float(got[:rows, :cols].mean()) - float(want.mean())) < 1.5, c


@needs_roi
def test_header_reads_size_orientation_and_colour_space() -> None:
    assert jc is not None
    data = photo_jpeg(75, 130)
    assert jc.header(data) == (75, 130, 1, 1)
    assert jc.header(rotated_jpeg(6))[2] == 6
    assert jc.header(cmyk_jpeg())[3] == 0


@needs_roi
@pytest.mark.parametrize(
    "args",
    [(0, 0, 0, 10, 8), (0, 0, 10, 0, 8), (70, 0, 10, 10, 8), (0, 125, 10, 10, 8), (0, 0, 5, 5, 0)],
)
def test_bad_regions_raise(args: tuple[int, ...]) -> None:
    assert jc is not None
    with pytest.raises(ValueError):
        jc.decode(photo_jpeg(75, 130), *args)


@needs_roi
@pytest.mark.parametrize(
    "data", [b"\xff\xd8garbage" * 20, b"", b"\x89PNG\r\n\x1a\n"], ids=["garbage", "empty", "png"]
)
def test_undecodable_bytes_raise_value_error(data: bytes) -> None:
    assert jc is not None
    with pytest.raises(ValueError, match="jpeg"):
        jc.header(data)
    with pytest.raises(ValueError, match="jpeg"):
        jc.decode(data, 0, 0, 1, 1, 8)


@needs_roi
def test_truncated_jpeg_with_an_end_marker_decodes_like_opencv() -> None:
    data = photo_jpeg(200, 200)[:5000] + b"\xff\xd9"  # libjpeg greys out the rest, as in OpenCV
    assert np.array_equal(region(data, Crop(0, 0, 200, 200), 8), full_decode(data))


@needs_roi
def test_arguments_out_of_range_are_refused_not_wrapped() -> None:
    assert jc is not None
    data = photo_jpeg(75, 130)
    for args in [(2**32 + 3, 0, 5, 5, 8), (0, -1, 5, 5, 8), (0, 0, 5, 5, 2**32 + 8), (0, 0, 5, 5, 9)]:
        with pytest.raises(ValueError):
            jc.decode(data, *args)


def with_xmp_first(jpeg: bytes) -> bytes:
    """An XMP APP1 segment before the EXIF one, as some editors write them."""
    body = b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta/>"
    return jpeg[:2] + b"\xff\xe1" + (len(body) + 2).to_bytes(2, "big") + body + jpeg[2:]


@needs_roi
def test_orientation_is_found_behind_an_xmp_block(tmp_path: Path) -> None:
    assert jc is not None
    data = with_xmp_first(rotated_jpeg(6))
    assert jc.header(data)[2] == 6
    for seed in range(5):
        assert np.array_equal(
            load(tmp_path, data, ".jpg", seed, roi=True), load(tmp_path, data, ".jpg", seed, roi=False)
        )


@needs_roi
def test_damaged_progressive_regions_equal_the_whole_decode() -> None:
    # Block smoothing of missing coefficients reads neighbouring blocks left of the crop. Compared
    # with this library's own whole-image decode: OpenCV's bundled libjpeg-turbo smooths damaged
    # progressive files slightly differently (up to 10 levels here) whatever the region.
    data = photo_jpeg(240, 320, seed=8, flags=JPEG_KINDS["progressive"])
    rng = np.random.default_rng(0)
    for cut in range(len(data) // 8, len(data) - 2, len(data) // 8):
        damaged = data[:cut] + b"\xff\xd9"
        whole = region(damaged, Crop(0, 0, 240, 320), 8)
        for c in random_regions(rng, 240, 320, n=15):
            got = region(damaged, c, 8)
            assert np.array_equal(got, whole[c.top : c.top + c.height, c.left : c.left + c.width]), (cut, c)


def rotated_jpeg(orientation: int) -> bytes:
    image = Image.fromarray(render_photo(np.random.default_rng(5), 2, 160, 90)[:, :, ::-1])
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def cmyk_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("CMYK", (64, 48), (10, 200, 30, 40)).save(buf, format="JPEG")
    return buf.getvalue()


def png_bytes() -> bytes:
    return bytes(cv2.imencode(".png", render_photo(np.random.default_rng(1), 0, 90, 70))[1])


def load(tmp_path: Path, data: bytes, suffix: str, seed: int, roi: bool, size: int = 48) -> np.ndarray:
    path = tmp_path / f"img{suffix}"
    path.write_bytes(data)
    out = np.empty((3, size, size), np.uint8)
    load_into(str(path), out, Recipe("train", "area", roi), np.random.default_rng(seed))
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: rotated_jpeg(6),
        cmyk_jpeg,
        png_bytes,
    ],
    ids=["exif-rotated", "cmyk", "png"],
)
def test_what_the_region_decoder_skips_goes_the_full_way(tmp_path: Path, make: Callable[[], bytes]) -> None:
    data = make()
    for seed in range(5):
        assert np.array_equal(
            load(tmp_path, data, ".img", seed, roi=True), load(tmp_path, data, ".img", seed, roi=False)
        )


@needs_roi
def test_unscaled_train_crops_equal_the_full_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 320x240 at output 224: no crop is ever 3x224 on both sides, so no scaling: exact equality.
    assert jc is not None
    counting = CountingDecoder(jc)
    monkeypatch.setattr(regions, "_jpegcrop", counting)
    data = photo_jpeg(240, 320, seed=6)
    for seed in range(30):
        a = load(tmp_path, data, ".jpg", seed, roi=True, size=224)
        b = load(tmp_path, data, ".jpg", seed, roi=False, size=224)
        assert np.array_equal(a, b), seed
    assert counting.calls == 30, "every crop went through the region decoder"


def test_scaled_train_crops_are_statistically_the_full_path(tmp_path: Path) -> None:
    data = photo_jpeg(1200, 1600, seed=7)
    scaled = 0
    diffs, shifts, sharp_roi, sharp_full = [], [], [], []
    for seed in range(40):
        c = random_resized_crop_params(np.random.default_rng(seed), 1200, 1600)
        is_scaled = roi_scale(c, 112) < 8
        scaled += is_scaled
        a = load(tmp_path, data, ".jpg", seed, roi=True, size=112).astype(int)
        b = load(tmp_path, data, ".jpg", seed, roi=False, size=112).astype(int)
        # Same crop and same flip: far closer to the full path than to its mirror image.
        assert np.abs(a - b).mean() < 0.25 * np.abs(a - b[:, :, ::-1]).mean(), seed
        diffs.append(np.abs(a - b).mean())
        shifts.append((a - b).mean())
        if jc is not None:  # unscaled crops are exact; scaled ones show the region path ran
            assert (diffs[-1] > 0) == is_scaled, seed
        sharp_roi.append(np.abs(np.diff(a, axis=2)).mean())
        sharp_full.append(np.abs(np.diff(b, axis=2)).mean())
    if jc is not None:
        assert scaled >= 25  # the case under test did happen (31 of 40 when written)
    # Measured when written: mean absolute difference 1.9, brightness shift 0.07, sharpness 0.984.
    assert np.mean(diffs) < 3.0 and abs(np.mean(shifts)) < 0.5
    assert 0.96 < np.mean(sharp_roi) / np.mean(sharp_full) < 1.04


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9",
        photo_jpeg(200, 300)[:6000],
        photo_jpeg(200, 300)[:2] + b"\x00" + photo_jpeg(200, 300)[2:],
    ],
    ids=["garbage", "truncated", "stray-byte-after-soi"],
)
def test_bad_jpegs_are_decode_errors_on_either_path(tmp_path: Path, data: bytes) -> None:
    # Truncated: OpenCV refuses it, even where the crop lies in the part that is there.
    for seed in range(8):
        for roi in (True, False):
            with pytest.raises(DecodeError):
                load(tmp_path, data, ".jpg", seed, roi)


@needs_roi
def test_pixel_limit_leaves_the_refusal_to_opencv(monkeypatch: pytest.MonkeyPatch) -> None:
    data = photo_jpeg(100, 100)
    assert regions.roi_header(data) == (100, 100)
    monkeypatch.setenv("OPENCV_IO_MAX_IMAGE_PIXELS", "9999")
    assert regions.roi_header(data) is None


def test_roi_scale_keeps_headroom_over_the_output_size() -> None:
    assert roi_scale(Crop(0, 0, 1343, 5000), 224) == 8
    assert roi_scale(Crop(0, 0, 1344, 1344), 224) == 4
    assert roi_scale(Crop(0, 0, 2700, 3000), 224) == 2
    assert roi_scale(Crop(0, 0, 6000, 5400), 224) == 1
    rng = np.random.default_rng(0)
    for _ in range(500):
        c = Crop(0, 0, int(rng.integers(1, 9000)), int(rng.integers(1, 9000)))
        for headroom in (1.5, 2.0, 3.0):
            num = roi_scale(c, 224, headroom)
            assert num == 8 or min(c.height, c.width) * num >= 224 * 8 * headroom
            assert num == 1 or min(c.height, c.width) * num / 2 < 224 * 8 * headroom  # the smallest


def test_decoder_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"}
    assert not load_config(None, {**base, "decoder": "opencv"}).roi
    assert load_config(None, base).roi == (jc is not None)
    with pytest.raises(ConfigError, match="decoder must be one of"):
        load_config(None, {**base, "decoder": "turbo"})
    monkeypatch.setattr(decoders, "_jpegcrop", None)
    with pytest.raises(ConfigError, match=r"region decoder .* is not built"):
        load_config(None, {**base, "decoder": "jpeg-roi"})
    assert not load_config(None, base).roi
