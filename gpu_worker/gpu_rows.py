"""Encoded rows decoded by the GPU's JPEG engine (nvJPEG through ``torchvision.io.decode_jpeg`` on a CUDA
device), then cropped, resized and flipped on the GPU straight into the batch's device rows. Chosen
at run time: a CUDA loader whose torchvision decodes on the device uses it; every other loader
decodes encoded rows on its CPU threads (``row_decoder``). tests/gpu runs it where a GPU is visible.

NOTE [ The GPU decoder's memory ]
    nvJPEG's batched hardware path writes its output when it is called, not in stream order: memory
    that the caching allocator hands the decoder may still be read or written by kernels queued
    before (torchvision 0.28 and torchcodec 0.16 corrupted images so: pytorch/vision PR #9606,
    torchcodec PR #1634). So the decoder runs on a stream of its own, whose memory pool nothing
    else allocates from, and the host waits for that stream before each call: every kernel that
    could still use memory of that pool has finished when the engine writes. The training stream
    waits on an event for the decoded rows, which are recorded as used there. The decoder's
    outputs are freed after each batch, so GPU memory stays at the largest batch's images; varied
    image sizes (NVIDIA/nvImageCodec#24) grow it only as far as that.

Its pixels are not the CPU decode's byte for byte: nvJPEG's IDCT and upsampling differ from
libjpeg-turbo's, it decodes the whole image (no DCT scaling of the region), and torch's bilinear
(with anti-aliasing for ``bilinear-antialias``) and ``area`` resizes stand for OpenCV's. The crop,
flip, size and label are the service's; tests/gpu reports the mean difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.nn.functional import interpolate

from protocol.encoded import EVAL, LENGTH, MAX_PIXELS, BadRow, EncodedRow
from protocol.pixels.geometry import eval_geometry

Bad = list[tuple[int, str]]


def gpu_decoder(device: torch.device) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
    """``decode_jpeg`` onto ``device``, or None where this torchvision cannot decode on a GPU."""
    if device.type != "cuda":
        return None
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except (ImportError, RuntimeError, OSError):
        return None

    def decode(datas: list[torch.Tensor]) -> list[torch.Tensor]:
        out = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return decode


class GpuRows:
    """Decodes a batch's encoded rows into its device image rows."""

    def __init__(
        self,
        device: torch.device,
        decode: Callable[[list[torch.Tensor]], list[torch.Tensor]],
        max_pixels: int = MAX_PIXELS,
    ) -> None:
        """``max_pixels``: the service's limit; no row naming a larger image is decoded."""
        self.max_pixels = max_pixels
        self.device = device
        self._decode = decode
        self._stream = torch.cuda.Stream(device)

    def decode_into(
        self, image: torch.Tensor, table: npt.NDArray[np.int64], area: npt.NDArray[np.uint8]
    ) -> tuple[Bad, int]:
        """Write every encoded row ``table`` names into ``image`` (``[count, 3, S, S]`` uint8 on the
        device, used next on the current stream); the rows that could not be, and how many were."""
        bad: Bad = []
        rows: list[tuple[int, EncodedRow, torch.Tensor]] = []
        for r in np.flatnonzero(table[:, LENGTH] != 0).tolist():
            try:
                row = EncodedRow.check(table[r].tolist(), len(area), self.max_pixels)
            except BadRow as exc:
                bad.append((r, str(exc)))
                continue
            data = torch.from_numpy(area[row.offset : row.offset + row.length].copy())
            rows.append((r, row, data))
        if not rows:
            return bad, 0
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the rows it writes are the batch's, staged on the current one
        self._stream.synchronize()  # NOTE [ The GPU decoder's memory ]: nothing queued may use its pool
        made = 0
        with torch.cuda.stream(self._stream):
            decoded = self._decode_all(rows, bad)
            for (r, row, _), pixels in zip(rows, decoded, strict=True):
                if pixels is None:
                    continue
                if tuple(pixels.shape) != (3, row.height, row.width):
                    bad.append(
                        (r, f"the GPU decoder gave {tuple(pixels.shape)} for {row.height} x {row.width}")
                    )
                    continue
                image[r].copy_(_place(pixels, row, image.shape[-1]))
                made += 1
            done = torch.cuda.Event()
            done.record(self._stream)
        current.wait_event(done)
        image.record_stream(self._stream)
        return bad, made

    def _decode_all(
        self, rows: list[tuple[int, EncodedRow, torch.Tensor]], bad: Bad
    ) -> list[torch.Tensor | None]:
        """One batched call; where it refuses, each row alone, so one bad file costs its row."""
        try:
            return list(self._decode([data for _, _, data in rows]))
        except RuntimeError:
            pass
        out: list[torch.Tensor | None] = []
        for r, _, data in rows:
            try:
                out.append(self._decode([data])[0])
            except RuntimeError as exc:
                bad.append((r, f"GPU decoder: {str(exc).splitlines()[0][:160]}"))
                out.append(None)
        return out


def _place(pixels: torch.Tensor, row: EncodedRow, size: int) -> torch.Tensor:
    """The row's crop of the decoded ``pixels`` (3 x H x W) resized to ``size`` and flipped: the
    service's geometry, torch's filters."""
    if row.mode == EVAL:
        new_h, new_w, c = eval_geometry(row.height, row.width, size)
        whole = _resize(pixels, new_h, new_w, row.filter)
        return whole[:, c.top : c.top + size, c.left : c.left + size]
    crop = pixels[:, row.top : row.top + row.crop_height, row.left : row.left + row.crop_width]
    out = _resize(crop, size, size, row.filter)
    return out.flip(-1) if row.flip else out


def _resize(pixels: torch.Tensor, height: int, width: int, name: str) -> torch.Tensor:
    mode: dict[str, Any] = (
        {"mode": "area"}
        if name == "area"
        else {"mode": "bilinear", "antialias": name == "bilinear-antialias"}
    )
    if mode["mode"] == "bilinear":
        mode["align_corners"] = False
    resized = interpolate(pixels[None].float(), size=(height, width), **mode)[0]
    return resized.round_().clamp_(0, 255).to(torch.uint8)
