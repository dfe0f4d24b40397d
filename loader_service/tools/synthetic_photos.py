"""Render one synthetic, photo-like image: ``render_photo`` and the layers it paints.

Loader benchmarks are only meaningful when the bytes look like real photos:
flat colours compress to almost nothing and decode unrealistically fast, while
white noise is incompressible and decodes slowly.  The images rendered here
mimic the statistics that drive JPEG cost on ImageNet-like data -- a roughly
1/f amplitude spectrum, correlated colour channels, occluding objects with
soft edges, smooth illumination and mild sensor noise -- so file sizes,
decode times and chroma behaviour land in the same range, with no downloads.

The output is a pure function of the generator's state and the arguments. Any change to what is
drawn here changes the bytes of every sample dataset: bump ``GENERATOR_VERSION`` in
``sample_data`` with it, so a tree cached by the old renderer is regenerated.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from functools import lru_cache

import cv2
import numpy as np
from numpy.typing import NDArray

__all__ = ["ByteImage", "FloatImage", "render_photo"]

FloatImage = NDArray[np.float32]
ByteImage = NDArray[np.uint8]

_STYLE_SALT = 0x5A3D_F0E1  # keeps class styles independent of dataset seeds

_SHAPE_ELLIPSE, _SHAPE_POLYGON, _SHAPE_BLOB = 0, 1, 2


@dataclass(frozen=True)
class _ClassStyle:
    """Per-class traits, so a small CNN has something learnable per class."""

    hue: float
    saturation: float
    value: float
    object_hue_shift: float
    background_slope: float
    texture_slope: float
    texture_contrast: float
    anisotropy: float
    grain_angle: float
    shape_probs: tuple[float, float, float]
    mean_objects: float
    object_scale: float
    clutter: float
    horizon_prob: float


@dataclass(frozen=True)
class _Look:
    """One image's draw from its class style: the within-class variation."""

    style: _ClassStyle
    base_bgr: tuple[float, float, float]
    sky_bgr: tuple[float, float, float]
    background_contrast: float
    light_angle: float
    light_strength: float
    noise_sigma: float
    lens_sigma: float


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def render_photo(rng: np.random.Generator, class_id: int, width: int, height: int) -> ByteImage:
    """Render one HxWx3 uint8 BGR photo-like image of class ``class_id``.

    Built as a layered scene (textured background, occluding objects, light,
    lens blur, sensor noise) because each layer contributes a piece of the
    spectrum and colour statistics that make JPEG behave as on real photos.
    """
    if width < 8 or height < 8:
        raise ValueError(f"width and height must be >= 8, got {width}x{height}")
    if class_id < 0:
        raise ValueError(f"class_id must be >= 0, got {class_id}")
    look = _sample_look(rng, _class_style(class_id))
    luminance, texture_a, texture_b = _pink_fields(rng, height, width, look.style)
    canvas = _background(rng, luminance, look)
    for radius in _object_radii(rng, look.style, min(width, height)):
        _paint_object(rng, canvas, (texture_a, texture_b), look, radius)
    return _finish(rng, _apply_illumination(rng, canvas, look), look)


# --------------------------------------------------------------------------
# Class style and per-image look
# --------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _class_style(class_id: int) -> _ClassStyle:
    """Derived from the class id alone, so a class looks alike across seeds."""
    rng = np.random.default_rng(np.random.SeedSequence([_STYLE_SALT, class_id]))
    shape_weights = rng.dirichlet((0.7, 0.7, 0.7))
    return _ClassStyle(
        hue=(class_id * 0.618034 + rng.uniform(-0.05, 0.05)) % 1.0,
        saturation=rng.uniform(0.15, 0.6),
        value=rng.uniform(0.35, 0.75),
        object_hue_shift=rng.uniform(0.1, 0.5),
        background_slope=rng.uniform(0.9, 1.1),
        texture_slope=rng.uniform(0.85, 1.1),
        texture_contrast=rng.uniform(0.35, 0.7),
        anisotropy=rng.uniform(0.0, 0.8),
        grain_angle=rng.uniform(0.0, math.pi),
        shape_probs=(float(shape_weights[0]), float(shape_weights[1]), float(shape_weights[2])),
        mean_objects=rng.uniform(3.0, 9.0),
        object_scale=rng.uniform(0.12, 0.3),
        clutter=rng.uniform(0.0, 10.0),
        horizon_prob=rng.choice((0.0, 0.3, 0.8)),
    )


def _hsv_to_bgr(hue: float, saturation: float, value: float) -> tuple[float, float, float]:
    """OpenCV wants BGR; colorsys gives RGB in [0, 1]."""
    red, green, blue = colorsys.hsv_to_rgb(
        hue % 1.0, float(np.clip(saturation, 0, 1)), float(np.clip(value, 0.02, 1))
    )
    return blue, green, red


def _sample_look(rng: np.random.Generator, style: _ClassStyle) -> _Look:
    """Jitter the class palette and camera so a class is a family, not a clone."""
    hue = style.hue + rng.normal(0.0, 0.04)
    base = _hsv_to_bgr(hue, style.saturation * rng.uniform(0.6, 1.3), style.value * rng.uniform(0.7, 1.25))
    sky = _hsv_to_bgr(rng.uniform(0.5, 0.66), rng.uniform(0.05, 0.45), rng.uniform(0.6, 0.95))
    return _Look(
        style=style,
        base_bgr=base,
        sky_bgr=sky,
        background_contrast=rng.uniform(0.5, 0.8),
        light_angle=rng.uniform(0.0, 2.0 * math.pi),
        light_strength=rng.uniform(0.05, 0.35),
        noise_sigma=rng.uniform(1.0, 3.0),
        lens_sigma=rng.uniform(0.2, 0.6),
    )


def _object_radii(rng: np.random.Generator, style: _ClassStyle, short_side: int) -> list[float]:
    """A few subjects plus scale-invariant clutter, largest first.

    Real scenes contain occluders at every scale (a dead-leaves picture);
    drawing the small ones from a power law keeps the spectrum near 1/f^2,
    and painting large to small keeps the clutter visible in front.
    """
    subjects = int(np.clip(rng.poisson(style.mean_objects), 1, 12))
    radii = np.clip(rng.lognormal(math.log(style.object_scale), 0.45, subjects), 0.04, 0.6)
    clutter = int(min(rng.poisson(style.clutter), 60))
    low, high = 0.012, 0.06
    # Inverse-CDF sampling of p(r) ~ r^-3 between low and high.
    u = rng.random(clutter)
    small = 1.0 / np.sqrt(u / (low * low) + (1.0 - u) / (high * high))
    both = np.concatenate([radii, small]) * short_side
    return sorted((float(r) for r in both), reverse=True)


# --------------------------------------------------------------------------
# Rendering layers
# --------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _spectral_grid(fh: int, fw: int) -> tuple[FloatImage, FloatImage, FloatImage]:
    """Cached: ImageNet-like sizes repeat a lot and the grid costs as much as the FFT."""
    fy = np.fft.fftfreq(fh).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(fw).astype(np.float32)[None, :]
    radius_sq = fx * fx + fy * fy
    radius_sq[0, 0] = 1.0
    log_radius = (0.5 * np.log(radius_sq)).astype(np.float32)
    cos_2a = ((fx * fx - fy * fy) / radius_sq).astype(np.float32)
    sin_2a = (2.0 * fx * fy / radius_sq).astype(np.float32)
    for shared in (log_radius, cos_2a, sin_2a):
        shared.flags.writeable = False  # cached and shared between calls
    return log_radius, cos_2a, sin_2a


def _pink_fields(
    rng: np.random.Generator, height: int, width: int, style: _ClassStyle
) -> tuple[FloatImage, FloatImage, FloatImage]:
    """1/f^slope random fields from one batched inverse FFT.

    Synthesising directly in the frequency domain gives the natural-image
    power law for the cost of a single transform; the third field is
    anisotropic so classes can have a grain direction (bark, grass, fabric).
    Uniform rather than Gaussian coefficients: the inverse transform sums so
    many of them that the result is Gaussian anyway, and they are 5x cheaper.
    """
    fh, fw = cv2.getOptimalDFTSize(height), cv2.getOptimalDFTSize(width)
    log_radius, cos_2a, sin_2a = _spectral_grid(fh, fw)
    grain = 1.0 + style.anisotropy * (
        cos_2a * math.cos(2.0 * style.grain_angle) + sin_2a * math.sin(2.0 * style.grain_angle)
    )
    texture = np.exp(-style.texture_slope * log_radius)
    amplitude = np.stack([np.exp(-style.background_slope * log_radius), texture, grain * texture])
    amplitude[:, 0, 0] = 0.0
    # Expected std of each field (Parseval), so textures keep natural contrast
    # variation between images instead of being forced to unit variance.
    scale = np.sqrt((amplitude * amplitude).sum(axis=(1, 2)) / 3.0) / (fh * fw)
    amplitude /= scale[:, None, None].astype(np.float32)
    spectrum = np.empty(amplitude.shape, dtype=np.complex64)
    spectrum.real = rng.random(amplitude.shape, dtype=np.float32) - 0.5
    spectrum.imag = rng.random(amplitude.shape, dtype=np.float32) - 0.5
    spectrum *= amplitude
    fields = np.fft.irfft2(spectrum, s=(fh, fw))[:, :height, :width]
    return fields[0], fields[1], fields[2]


def _tint(luma: FloatImage, bgr: tuple[float, float, float]) -> FloatImage:
    """Luma times a colour; cv2.merge is several times faster than broadcasting."""
    luma = luma.astype(np.float32, copy=False)
    return np.asarray(cv2.merge([luma * np.float32(c) for c in bgr]), dtype=np.float32)


def _gray3(weights: FloatImage) -> FloatImage:
    """Replicate per-pixel weights to 3 channels for cv2 element-wise ops."""
    return np.asarray(cv2.cvtColor(weights, cv2.COLOR_GRAY2BGR), dtype=np.float32)


def _blend(top: FloatImage, bottom: FloatImage, alpha: FloatImage) -> FloatImage:
    """Alpha compositing; cv2.blendLinear avoids numpy's slow 3-channel broadcast."""
    return np.asarray(cv2.blendLinear(top, bottom, alpha, 1.0 - alpha), dtype=np.float32)


def _background(rng: np.random.Generator, luminance: FloatImage, look: _Look) -> FloatImage:
    """Multiplicative luminance keeps channels correlated, as in real photos."""
    height, width = luminance.shape
    shade = np.exp(look.background_contrast * luminance)
    canvas = _tint(shade, look.base_bgr)
    canvas += _chroma_wash(rng, height, width)
    if rng.random() < look.style.horizon_prob:
        canvas = _add_horizon(rng, canvas, shade, look)
    return canvas


def _chroma_wash(rng: np.random.Generator, height: int, width: int) -> FloatImage:
    """Slow colour drift: chroma in photos varies far more smoothly than luma."""
    small_h, small_w = max(2, height // 16), max(2, width // 16)
    noise = rng.standard_normal((small_h, small_w, 3), dtype=np.float32)
    wash = np.asarray(cv2.GaussianBlur(noise, (0, 0), 1.5), dtype=np.float32)
    wash = 0.06 * (wash - wash.mean(axis=2, keepdims=True))
    return np.asarray(cv2.resize(wash, (width, height), interpolation=cv2.INTER_LINEAR), dtype=np.float32)


def _add_horizon(rng: np.random.Generator, canvas: FloatImage, shade: FloatImage, look: _Look) -> FloatImage:
    """Sky-over-ground split: a very common large-scale photo structure.

    The sky reuses a damped copy of the ground texture so it reads as haze
    or cloud rather than a flat fill that would compress unrealistically.
    """
    height, width = shade.shape
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)
    wave = np.sin(2.0 * math.pi * (rng.uniform(0.3, 2.0) * xs + rng.uniform(0.0, 1.0)))
    line = rng.uniform(0.25, 0.6) * height + 0.05 * height * wave
    ys = np.arange(height, dtype=np.float32)[:, None]
    sky_alpha = np.clip((line[None, :] - ys) / rng.uniform(1.0, 4.0) + 0.5, 0.0, 1.0).astype(np.float32)
    sky_luma = np.power(shade, 0.4) * (1.0 + 0.25 * ys / height)
    return _blend(_tint(sky_luma.astype(np.float32), look.sky_bgr), canvas, sky_alpha)


def _shape_outline(
    rng: np.random.Generator, kind: int, cx: float, cy: float, radius: float
) -> NDArray[np.float64]:
    """Every shape becomes a polygon so one anti-aliased fill draws them all."""
    rotation = rng.uniform(0.0, 2.0 * math.pi)
    if kind == _SHAPE_POLYGON:
        theta = np.sort(rng.uniform(0.0, 2.0 * math.pi, int(rng.integers(3, 9))))
        rho = radius * rng.uniform(0.6, 1.2, theta.size)
    else:
        theta = np.linspace(0.0, 2.0 * math.pi, 72, endpoint=False)
        if kind == _SHAPE_ELLIPSE:
            ratio = rng.uniform(0.35, 1.0)
            rho = radius * ratio / np.sqrt((ratio * np.cos(theta)) ** 2 + np.sin(theta) ** 2)
        else:
            harmonics = np.arange(2, 6)
            amps = rng.uniform(0.0, 0.18, harmonics.size) / np.sqrt(harmonics - 1)
            phases = rng.uniform(0.0, 2.0 * math.pi, harmonics.size)
            wobble = amps[:, None] * np.cos(harmonics[:, None] * theta + phases[:, None])
            rho = radius * (1.0 + wobble.sum(axis=0))
    angles = theta + rotation
    return np.stack([cx + rho * np.cos(angles), cy + rho * np.sin(angles)], axis=1)


def _soft_mask(
    outline: NDArray[np.float64], origin: tuple[int, int], size: tuple[int, int], sigma: float
) -> FloatImage:
    """Anti-aliased fill plus blur: real edges are never one-pixel steps.

    Wide blurs (shadows, defocus) use stack blur, whose cost does not grow
    with the radius; the difference from a Gaussian is invisible there.
    """
    mask = np.zeros(size, dtype=np.uint8)
    points = np.round((outline - origin) * 16.0).astype(np.int32)
    cv2.fillPoly(mask, [points], (255,), lineType=cv2.LINE_AA, shift=4)
    soft = mask.astype(np.float32) * np.float32(1.0 / 255.0)
    if sigma > 2.0:
        ksize = 2 * math.ceil(2.45 * sigma) + 1
        return np.asarray(cv2.stackBlur(soft, (ksize, ksize)), dtype=np.float32)
    return np.asarray(cv2.GaussianBlur(soft, (0, 0), sigma), dtype=np.float32)


def _paint_object(
    rng: np.random.Generator,
    canvas: FloatImage,
    textures: tuple[FloatImage, FloatImage],
    look: _Look,
    radius: float,
) -> None:
    """Composite one occluder inside its bounding box to keep the cost per object small."""
    height, width = canvas.shape[:2]
    cx, cy = rng.uniform(-0.1, 1.1) * width, rng.uniform(-0.1, 1.1) * height
    kind = int(rng.choice(3, p=np.asarray(look.style.shape_probs)))
    outline = _shape_outline(rng, kind, cx, cy, radius)
    edge_sigma = rng.uniform(0.5, 1.2) if rng.random() < 0.8 else rng.uniform(1.5, 4.0)
    shadow_shift = radius * 0.15 * np.array([-math.cos(look.light_angle), -math.sin(look.light_angle)])
    pad = int(3.0 * max(edge_sigma, radius * 0.1) + np.abs(shadow_shift).max() + 3.0)
    x0, y0 = max(0, int(outline[:, 0].min()) - pad), max(0, int(outline[:, 1].min()) - pad)
    x1, y1 = min(width, int(outline[:, 0].max()) + pad + 1), min(height, int(outline[:, 1].max()) + pad + 1)
    if x1 - x0 < 2 or y1 - y0 < 2:
        return
    size, origin = (y1 - y0, x1 - x0), (x0, y0)
    roi = canvas[y0:y1, x0:x1]
    if rng.random() < 0.5:
        shadow = _soft_mask(outline + shadow_shift, origin, size, max(2.0, radius * 0.1))
        roi[...] = cv2.multiply(roi, _gray3(1.0 - rng.uniform(0.2, 0.5) * shadow))
    mask = _soft_mask(outline, origin, size, edge_sigma)
    patches = (textures[0][y0:y1, x0:x1], textures[1][y0:y1, x0:x1])
    surface = _object_surface(rng, patches, look, (cx - x0, cy - y0), radius)
    roi[...] = _blend(surface, roi, mask)


def _object_surface(
    rng: np.random.Generator,
    textures: tuple[FloatImage, FloatImage],
    look: _Look,
    centre: tuple[float, float],
    radius: float,
) -> FloatImage:
    """Own colour, own texture and soft 3-D shading, so objects read as things.

    Mixing two independent fields with a random angle yields a fresh field
    with the same statistics, giving each object a distinct texture for free.
    """
    style = look.style
    phi = rng.uniform(0.0, 2.0 * math.pi)
    texture = math.cos(phi) * textures[0] + math.sin(phi) * textures[1]
    contrast = style.texture_contrast * rng.uniform(0.4, 1.6)
    hue = style.hue + style.object_hue_shift * rng.choice((-1.0, 1.0)) + rng.normal(0.0, 0.05)
    colour = _hsv_to_bgr(hue, rng.uniform(0.15, 0.8), rng.uniform(0.25, 0.95))
    rows, cols = texture.shape
    ys = (np.arange(rows, dtype=np.float32)[:, None] - np.float32(centre[1])) / np.float32(radius)
    xs = (np.arange(cols, dtype=np.float32)[None, :] - np.float32(centre[0])) / np.float32(radius)
    lx, ly = math.cos(look.light_angle), math.sin(look.light_angle)
    bulge = rng.uniform(0.0, 0.35)
    shading = 1.0 + 0.25 * (xs * lx + ys * ly) - bulge * np.minimum(xs * xs + ys * ys, 1.5)
    luma = np.exp(contrast * texture) * np.clip(shading, 0.3, 1.5)
    return _tint(luma.astype(np.float32), colour)


def _apply_illumination(rng: np.random.Generator, canvas: FloatImage, look: _Look) -> FloatImage:
    """Smooth light fall-off, vignetting and a warm or cool tint.

    The light field is smooth, so it is computed on a coarse grid and
    upsampled; bilinear interpolation of a ramp-plus-quadratic is exact enough.
    """
    height, width = canvas.shape[:2]
    ys = np.linspace(-1.0, 1.0, max(2, height // 8), dtype=np.float32)[:, None]
    xs = np.linspace(-1.0, 1.0, max(2, width // 8), dtype=np.float32)[None, :]
    ramp = look.light_strength * (xs * math.cos(look.light_angle) + ys * math.sin(look.light_angle))
    vignette = rng.uniform(0.0, 0.125) * (xs * xs + ys * ys)
    tint = 1.0 + rng.normal(0.0, 0.04, 3)
    light = _tint((1.0 + ramp - vignette).astype(np.float32), (tint[0], tint[1], tint[2]))
    full = cv2.resize(light, (width, height), interpolation=cv2.INTER_LINEAR)
    return np.asarray(cv2.multiply(canvas, full), dtype=np.float32)


def _finish(rng: np.random.Generator, canvas: FloatImage, look: _Look) -> ByteImage:
    """Lens softness, then sensor noise and quantisation, as in a camera.

    Uniform byte noise stands in for Gaussian: at a sigma of 1-3 levels the
    shape is irrelevant after quantisation and it is several times cheaper;
    cv2.addWeighted scales, adds, rounds and saturates in one pass.
    """
    blurred = cv2.GaussianBlur(canvas, (0, 0), look.lens_sigma)
    noise = rng.integers(0, 256, canvas.shape, dtype=np.uint8)
    beta = look.noise_sigma * math.sqrt(12.0) / 256.0
    out = cv2.addWeighted(blurred, 255.0, noise, beta, -127.5 * beta, dtype=cv2.CV_8U)
    return np.asarray(out, dtype=np.uint8)
