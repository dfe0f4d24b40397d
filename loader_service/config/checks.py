"""Checks of single option values: each takes (option name, value) and says what is wrong, or None."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq.auth

from loader_service.dataset.storage.location import Location
from loader_service.decode.contract import parse_spec
from loader_service.decode.decoders import decoder_problem
from protocol.curve import is_loopback

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

Check = Callable[[str, Any], str | None]


def between(low: int, high: int, low_text: str = "") -> Check:
    def check(name: str, value: Any) -> str | None:
        ok = low <= value <= high
        return None if ok else f"{name} must be between {low_text or low} and {high}"

    return check


def at_least(low: int) -> Check:
    return lambda name, value: None if value >= low else f"{name} must be at least {low}"


def positive(name: str, value: Any) -> str | None:
    # A TOML file may say `inf` or `nan`; neither is a usable timeout.
    return None if math.isfinite(value) and value > 0 else f"{name} must be positive"


def seed(name: str, value: Any) -> str | None:
    return None if 0 <= value < 2**63 else f"{name} must be a non-negative 63-bit integer"


def feed_name(name: str, value: Any) -> str | None:
    return None if 1 <= len(value) <= 64 else f"{name} must be 1 to 64 characters"


def log_level(name: str, value: Any) -> str | None:
    return None if value.upper() in LOG_LEVELS else f"{name} must be one of {', '.join(LOG_LEVELS)}"


def decoder(name: str, value: Any) -> str | None:
    return decoder_problem(value)


def data_source(name: str, value: Any) -> str | None:
    if not str(value):
        return f"{name} is empty"
    where = Location.of(value)  # NOTE [ One location ]
    if where.in_store:
        return None  # the store is asked when the feed is indexed
    path = where.path.expanduser()
    if "{" in path.name:  # a brace pattern of shards: its folder must exist, the index checks the rest
        ok = path.parent.is_dir()
        return None if ok else f"{name}: the folder of {value} does not exist"
    return None if path.exists() else f"{name} {value} does not exist"


def pipeline(name: str, value: Any) -> str | None:
    if not value:
        return None
    try:
        module, _func = parse_spec(value)  # the grammar the workers load it by
    except ValueError as exc:
        return str(exc)
    if module.endswith(".py") and not Path(module).expanduser().is_file():
        return f"{name}: file {module} does not exist"
    return None


def endpoint(name: str, value: Any) -> str | None:
    if not value.startswith("ipc://"):
        ok = value.startswith("tcp://")
        return None if ok else f"{name} must be ipc://PATH or tcp://HOST:PORT: {value}"
    path = value[len("ipc://") :]
    # The kernel's sockaddr_un limit: longer paths fail obscurely inside libzmq.
    if not 0 < len(path.encode()) <= 107:
        return f"ipc path must be 1 to 107 bytes: {value}"
    parent = os.path.dirname(path) or "."
    return None if os.path.isdir(parent) else f"directory for ipc endpoint does not exist: {parent}"


KEYS_HINT = "make keys with `loader-service keys --out DIR` (docs/trainers.md: Trainers on other hosts)"


def security(endpoint: str, secret_key: str, authorized: str, insecure: bool) -> str | None:
    """CURVE is all or nothing, and every tcp:// endpoint needs it or an explicit opt-out.

    Loopback is no exception: any local user can connect to it (an ipc socket's file mode keeps
    them out), and libzmq buffers a peer's unfinished multipart message whole before the service
    sees a byte of it, so only authorised peers may reach a socket at all (docs/trainers.md, Limits)."""
    if bool(secret_key) != bool(authorized):
        return "curve_secret_key and curve_authorized go together: give both or neither"
    if secret_key:
        return _key_files(secret_key, authorized)
    if endpoint.startswith("tcp://") and not insecure:
        reach = "every user of this host" if is_loopback(endpoint) else "other hosts"
        return (
            f"endpoint {endpoint} can be reached by {reach}: give --curve-secret-key and "
            f"--curve-authorized ({KEYS_HINT}), or --insecure-tcp to run it without authentication"
        )
    return None


def _key_files(secret_key: str, authorized: str) -> str | None:
    try:
        _public, secret = zmq.auth.load_certificate(secret_key)
    except (OSError, ValueError) as exc:
        return f"curve_secret_key: cannot read {secret_key}: {exc}"
    if secret is None:
        return f"curve_secret_key: {secret_key} holds no secret key (give the .key_secret file)"
    if not Path(authorized).is_dir():
        return f"curve_authorized: {authorized} is not a folder of trainers' .key files"
    return None
