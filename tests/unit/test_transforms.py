"""Decoding and the three transforms, on real encoded files."""

from __future__ import annotations

import io
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from loader_service.decode.transforms import Recipe, decode_file, transform_into
from protocol.pixels import DecodeError
from protocol.pixels.geometry import RATIO, eval_geometry, random_resized_crop_params


def write(path: Path, bgr: np.ndarray) -> str:
    assert cv2.imwrite(str(path), bgr)
    return str(path)


def test_bgr_becomes_rgb_chw(tmp_path: Path) -> None:
    bgr = np.zeros((40, 40, 3), np.uint8)
    bgr[:, :, 2] = 200  # red in OpenCV order
    out = np.empty((3, 16, 16), np.uint8)
    transform_into(
        decode_file(write(tmp_path / "r.png", bgr)), out, Recipe("none", "area"), np.random.default_rng(0)
    )
    assert (out[0] == 200).all() and (out[1] == 0).all() and (out[2] == 0).all()


def test_eval_geometry_follows_torchvision() -> None:
    # 375x500 landscape, S=224: shorter side to 256, long side int(256*500/375)=341, crop at round(58.5)=58.
    new_h, new_w, crop = eval_geometry(375, 500, 224)
    assert (new_h, new_w, crop.top, crop.left, crop.height, crop.width) == (256, 341, 16, 58, 224, 224)
    new_h, new_w, crop = eval_geometry(500, 375, 224)
    assert (new_h, new_w, crop.top, crop.left) == (341, 256, 58, 16)


def test_eval_keeps_the_centre(tmp_path: Path) -> None:
    bgr = np.zeros((300, 600, 3), np.uint8)
    bgr[:, 250:350] = 255  # a white bar in the middle third
    out = np.empty((3, 32, 32), np.uint8)
    transform_into(
        decode_file(write(tmp_path / "c.png", bgr)), out, Recipe("eval", "area"), np.random.default_rng(0)
    )
    assert out[:, :, 16].min() > 200 and out[:, :, 0].max() < 50


def test_random_resized_crop_params_stay_in_range() -> None:
    rng = np.random.default_rng(1)
    for _ in range(2000):
        h, w = int(rng.integers(20, 800)), int(rng.integers(20, 800))
        c = random_resized_crop_params(rng, h, w)
        assert c.top >= 0 and c.top + c.height <= h and c.left >= 0 and c.left + c.width <= w
        assert c.height > 0 and c.width > 0


def test_random_resized_crop_distribution() -> None:
    rng = np.random.default_rng(2)
    areas, ratios = [], []
    for _ in range(4000):
        c = random_resized_crop_params(rng, 480, 640)
        areas.append(c.height * c.width / (480 * 640))
        ratios.append(c.width / c.height)
    assert min(areas) > 0.07 and max(areas) <= 1.0
    # Draws of U(0.08, 1) that do not fit the image at the drawn aspect are retried, which lowers the
    # mean below 0.54 (0.43 for 4:3 images); far outside this band means the sampler is wrong.
    assert 0.35 < np.mean(areas) < 0.5
    assert np.mean(np.array(areas) > 0.75) > 0.05, "large crops still happen"
    assert RATIO[0] * 0.95 < min(ratios) and max(ratios) < RATIO[1] * 1.05
    square = [random_resized_crop_params(rng, 600, 600) for _ in range(4000)]
    # On a square image wide and tall crops fit equally often: log-aspect is symmetric about 0.
    assert abs(np.median([math.log(c.width / c.height) for c in square])) < 0.03


def test_train_flips_about_half_the_time(tmp_path: Path) -> None:
    bgr = np.zeros((64, 64, 3), np.uint8)
    bgr[:, :32] = 255  # white left half
    image = decode_file(write(tmp_path / "h.png", bgr))
    out = np.empty((3, 16, 16), np.uint8)
    straddling = [
        seed
        for seed in range(400)
        # the crop must cover the edge between the halves to tell left from right
        if (c := random_resized_crop_params(np.random.default_rng(seed), 64, 64)).left < 28
        and c.left + c.width > 36
    ]
    flips = 0
    for seed in straddling:
        transform_into(image, out, Recipe("train", "area"), np.random.default_rng(seed))
        flips += int(out[:, :, 0].mean() < out[:, :, -1].mean())
    assert len(straddling) > 100
    assert abs(flips / len(straddling) - 0.5) < 0.12


def test_same_rng_same_pixels(tmp_path: Path) -> None:
    image = decode_file(
        write(tmp_path / "n.png", np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8))
    )
    a, b = np.empty((3, 32, 32), np.uint8), np.empty((3, 32, 32), np.uint8)
    transform_into(image, a, Recipe("train", "area"), np.random.default_rng(5))
    transform_into(image, b, Recipe("train", "area"), np.random.default_rng(5))
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty file"),
        (b"not an image at all", "not a decodable image"),
        (b"\xff\xd8\xff\xe0" + b"\x00" * 50, "not a decodable"),
    ],
)
def test_bad_files_raise_decode_error(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.jpg"
    path.write_bytes(content)
    with pytest.raises(DecodeError, match=reason):
        decode_file(str(path))


def test_missing_file_raises_decode_error(tmp_path: Path) -> None:
    with pytest.raises(DecodeError, match="cannot read"):
        decode_file(str(tmp_path / "gone.jpg"))


def test_grayscale_rgba_and_16bit_become_3_channel_8bit(tmp_path: Path) -> None:
    gray = np.full((10, 12), 77, np.uint8)
    rgba = np.zeros((10, 12, 4), np.uint8)
    rgba[..., 2], rgba[..., 3] = 200, 255
    deep = np.full((10, 12, 3), 40000, np.uint16)
    assert (decode_file(write(tmp_path / "g.png", gray)) == 77).all()
    assert decode_file(write(tmp_path / "a.png", rgba))[0, 0].tolist() == [0, 0, 200]
    assert decode_file(write(tmp_path / "d.png", deep))[0, 0].tolist() == [40000 >> 8] * 3


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = 255  # stored landscape: white left half
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", exif=exif, quality=95)
    path = tmp_path / "rotated.jpg"
    path.write_bytes(buf.getvalue())
    shown = decode_file(str(path))
    assert shown.shape[:2] == (40, 20), "displayed portrait"
    assert shown[2, 10].min() > 200 and shown[-3, 10].max() < 50, "white half on top after rotation"
