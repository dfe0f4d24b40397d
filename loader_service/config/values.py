"""The value types of the options and how each is read from text (an environment variable) or
checked as TOML gave it; ``ConfigError`` for a value the service cannot run with."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ByteSize(int):
    """A number of bytes, given as an integer or with a binary suffix: ``64G``, ``512M``, ``1.5T``."""

    def __new__(cls, value: int | str = 0) -> ByteSize:
        if isinstance(value, str):
            return super().__new__(cls, parse_bytes(value))
        return super().__new__(cls, value)


ByteSize.__name__ = "size"  # what argparse names in "invalid size value: '12Q'"


class WorkerCount(int):
    """A number of decode workers, or ``auto`` (0): sized by the service (NOTE [ Sizing workers ])."""

    def __new__(cls, value: int | str = 0) -> WorkerCount:
        if isinstance(value, str):
            text = value.strip().lower()
            return super().__new__(cls, 0 if text == "auto" else int(text))
        return super().__new__(cls, value)

    def __str__(self) -> str:
        return "auto" if self == 0 else int.__str__(self)


WorkerCount.__name__ = "count"  # argparse: "invalid count value: 'many'"
_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])(?:I?B)?|B)?")
MAX_BYTES = 2**62


def parse_bytes(text: str) -> int:
    """``64G`` -> 68719476736: K, M, G, T are powers of 1024, optionally followed by ``B`` or ``iB``;
    a fraction must come to whole bytes (``1.5G`` does, ``0.5`` does not). ValueError otherwise."""
    match = _SIZE.fullmatch(text.strip().upper())
    value = float(match[1]) * _SUFFIXES[match[2] or ""] if match else -1.0
    if not (0 <= value < MAX_BYTES and value.is_integer()):
        raise ValueError(f"{text!r} is not a size such as 64G, 512M or 1000000 (bytes)")
    return int(value)


class ConfigError(ValueError):
    """A configuration value that the service cannot run with; the message says which and why."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        # The top-level option at fault, if it is one: load_config then adds which layer set it.
        self.key = key


def as_worker_count(value: Any, where: str) -> WorkerCount:
    """A TOML or flag value of ``workers``: an integer, or ``"auto"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f'{where} must be "auto" or a whole number')
    try:
        return WorkerCount(value)
    except ValueError:
        raise ConfigError(f'{where} must be "auto" or a whole number, not {value!r}') from None


def as_byte_size(value: Any, where: str) -> ByteSize:
    """A TOML or flag value of a size option: an integer of bytes, or text such as ``"64G"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f'{where} must be a whole number of bytes or text such as "64G"')
    if isinstance(value, int) and not 0 <= value < MAX_BYTES:
        raise ConfigError(f"{where} must be between 0 and 2**62 bytes")
    try:
        return ByteSize(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


FROM_TEXT: dict[type, Callable[[str], Any]] = {
    int: int,
    float: float,
    bool: parse_boolean,
    str: str,
    Path: str,
    ByteSize: ByteSize,
    WorkerCount: WorkerCount,
}
KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "a boolean (1, true, yes, on or 0, false, no, off)",
    str: "text",
    Path: "a path",
    ByteSize: "a size such as 64G, 512M or 1000000",
    WorkerCount: "auto or a whole number",
}


def require(ok: bool, message: str, key: str = "") -> None:
    if not ok:
        raise ConfigError(message, key)
