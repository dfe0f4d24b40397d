"""TFRecord's checksum: CRC-32C, masked. The C extension computes it (``_crc32c``); without it, the
same in Python, about a thousand times slower."""

from __future__ import annotations

import struct
from collections.abc import Callable

POLYNOMIAL = 0x82F63B78
"""Castagnoli's, reflected."""
_TABLE = [0] * 256
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ POLYNOMIAL if _c & 1 else _c >> 1
    _TABLE[_n] = _c


def python_crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC-32C in Python, a byte a step: what runs without the C extension."""
    crc = value ^ 0xFFFFFFFF
    for byte in bytes(data):
        crc = (crc >> 8) ^ _TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


crc32c: Callable[..., int]
try:
    from loader_service.dataset.formats.tfrecord._crc32c import crc32c
except ImportError:  # pragma: no cover - the extension is optional
    crc32c = python_crc32c


MASK_DELTA = 0xA282EAD8


def masked(data: bytes | memoryview) -> int:
    """The masked CRC-32C TFRecord stores: rotated right by 15 bits, plus a constant (mod 2^32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def length_checks(header: bytes) -> bool:
    """Whether a 12-byte record header's length and its masked CRC agree."""
    return len(header) == 12 and masked(header[:8]) == struct.unpack_from("<I", header, 8)[0]
