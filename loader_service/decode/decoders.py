"""Which decoder the train and eval transforms use (``--decoder``), and what to say about it; free of
OpenCV, so config and the service's main process may ask (NOTE [ The worker contract ])."""

from __future__ import annotations

import importlib.util
from types import ModuleType

_jpegcrop: ModuleType | None
try:
    from protocol.pixels import _jpegcrop
except ImportError:  # built only where libjpeg-turbo's headers were found at install time
    _jpegcrop = None

DECODERS = ("auto", "opencv", "jpeg-roi")
"""``auto``: the region decoder when it is built, else OpenCV; ``jpeg-roi`` insists on it."""


def roi_decoder_version() -> str | None:
    """The libjpeg-turbo version the region decoder was built against, or None if it is not built."""
    if _jpegcrop is None:
        return None
    number = int(getattr(_jpegcrop, "LIBJPEG_TURBO_VERSION_NUMBER", 0))
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}"


def installed(module: str) -> bool:
    """Whether ``module`` could be imported here, without importing it."""
    return importlib.util.find_spec(module) is not None


def antialias_problem() -> str | None:
    """Why ``bilinear-antialias`` cannot run here, or None: it needs the C resampler (built at
    install where a compiler was found) or, without it, torch (``geometry.prepare``)."""
    if installed("protocol.pixels._resample") or installed("torch"):
        return None
    return (
        "interpolation bilinear-antialias needs the C resampler, which was not built (no C compiler "
        "at install), or torch, which is not installed: reinstall with a compiler (gcc), install "
        "torch, or use --interpolation bilinear"
    )


def decoder_problem(choice: str) -> str | None:
    """Why the ``--decoder`` choice cannot be honoured on this install, or None."""
    if choice not in DECODERS:
        return f"decoder must be one of {', '.join(DECODERS)}"
    if choice == "jpeg-roi" and roi_decoder_version() is None:
        return (
            "decoder jpeg-roi: the region decoder (protocol.pixels._jpegcrop) is not built; install "
            "libjpeg-turbo's headers (Debian: libjpeg-dev) and reinstall dataferry, or use auto"
        )
    return None


def uses_roi(choice: str) -> bool:
    """Whether a (valid) ``--decoder`` choice makes train and eval crops go through the region decoder."""
    return choice != "opencv" and roi_decoder_version() is not None


def describe_decoder(choice: str) -> str:
    """One line for the service log: how the train transform decodes JPEGs, and why."""
    if uses_roi(choice):
        return (
            f"jpeg-roi (libjpeg-turbo {roi_decoder_version()}; train and eval crops decode only their region)"
        )
    if choice == "opencv":
        return "opencv (full decode; --decoder opencv)"
    return "opencv (full decode; the region decoder is not built: see docs/getting-started.md)"
