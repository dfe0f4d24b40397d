"""An image's bytes and what was decided for them (``EncodedRow``) made into one ``3 x S x S`` uint8
row: the service's region decode and a trainer's decode of an encoded row are this one function, so
the two give the same pixels (NOTE [ Encoded rows ] in protocol/encoded.py).

Every decode here ends in one strided numpy copy that turns OpenCV's BGR HWC into RGB CHW directly
in the output row and applies the flip in the same pass, so no batch-sized buffer exists.
"""

from __future__ import annotations

from typing import cast

import cv2
import numpy as np

from protocol.encoded import EVAL, EncodedRow
from protocol.pixels import DecodeError
from protocol.pixels.geometry import U8, Crop, eval_geometry, resize
from protocol.pixels.regions import decode_region, roi_header


def decode_bytes(data: bytes) -> U8:
    """Decode a whole file's bytes with OpenCV to BGR HWC uint8 (EXIF orientation applied, alpha
    dropped, 16-bit scaled); DecodeError with the reason if it cannot be."""
    try:
        image = cast(U8 | None, cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR))
    except cv2.error as exc:
        # OpenCV checks OPENCV_IO_MAX_IMAGE_PIXELS against the header before allocating pixels.
        if "MAX_IMAGE_PIXELS" in str(exc):
            raise DecodeError(
                "refused: more pixels than the configured limit (decompression bomb?)"
            ) from None
        raise DecodeError(f"decoder error: {str(exc).strip().splitlines()[-1][:160]}") from None
    if image is None or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
        raise DecodeError("not a decodable image")
    return image


def store(hwc_bgr: U8, out: U8, flip: bool = False) -> None:
    """Copy BGR HWC into the RGB CHW row ``out``, optionally mirrored, in one pass."""
    view = hwc_bgr[:, ::-1, ::-1] if flip else hwc_bgr[:, :, ::-1]
    np.copyto(out, view.transpose(2, 0, 1))


def apply_eval(image: U8, out: U8, interpolation: str, full: tuple[int, int] | None = None) -> None:
    """Resize, then keep the centre. ``full``: the (height, width) whose geometry applies, when
    ``image`` is a DCT-scaled canvas of it, so a scaled decode is cut exactly where a full one is."""
    size = out.shape[1]
    height, width = full or (image.shape[0], image.shape[1])
    new_h, new_w, c = eval_geometry(height, width, size)
    store(resize(image, new_w, new_h, interpolation, window=c), out)


def render(data: bytes, row: EncodedRow, out: U8, check: bool = True) -> None:
    """Write the row ``row`` describes, from the JPEG ``data``, into ``out`` (RGB CHW, ``3 x S x S``).

    ``check``: read the header first and refuse (DecodeError) a file whose size is not the row's or
    that the region decoder would not take (a trainer's decode: the row came from a peer); the
    service, which just read it, passes False. A file libjpeg-turbo refuses midway is decoded whole
    by OpenCV, as on the service, which then names what is wrong with it.
    """
    if check:
        found = roi_header(data)
        if found != (row.height, row.width):
            said = "not a JPEG the region decoder takes" if found is None else f"{found[0]} x {found[1]}"
            raise DecodeError(f"its header says {said}, where the service read {row.height} x {row.width}")
    crop = _crop(row)
    if row.mode == EVAL:
        _eval(data, row, out, crop)
        return
    decoded = decode_region(data, crop, row.scale)
    if decoded is None:  # the same crop on a whole decode: what the region decoder would have given
        region = decode_bytes(data)[crop.top : crop.top + crop.height, crop.left : crop.left + crop.width]
    else:
        region = decoded.crop(crop)
    size = out.shape[1]
    store(resize(region, size, size, row.filter), out, flip=row.flip)


def _crop(row: EncodedRow) -> Crop:
    return Crop(row.top, row.left, row.crop_height, row.crop_width)


def _eval(data: bytes, row: EncodedRow, out: U8, region: Crop) -> None:
    """Eval on a canvas holding only the centre's region (NOTE [ Eval regions ] in
    protocol/pixels/regions.py)."""
    decoded = decode_region(data, region, row.scale)
    if decoded is None:
        apply_eval(decode_bytes(data), out, row.filter)
        return
    # libjpeg-turbo's scaled image is ceil(side * num / 8) pixels on each side.
    num = row.scale
    canvas = np.empty((-(-row.height * num // 8), -(-row.width * num // 8), 3), np.uint8)
    decoded.place(canvas)
    apply_eval(canvas, out, row.filter, full=(row.height, row.width))
