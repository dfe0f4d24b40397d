"""``loader-service keys``: make a CURVE key pair for the service or for one trainer.

The files are pyzmq's certificate format (``zmq.auth``): ``NAME.key`` holds the public key and may
be copied anywhere; ``NAME.key_secret`` holds both keys and stays with its owner, mode 0600.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq.auth


class KeysError(ValueError):
    """The key pair cannot be written; the message says why."""


@dataclass(frozen=True)
class KeyPair:
    public: Path
    secret: Path


def default_name() -> str:
    """The host name, reduced to characters that are safe in a file name."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return name.strip(".") or "dataferry"


def make_keys(out: Path, name: str) -> KeyPair:
    """Write ``out/name.key`` and ``out/name.key_secret``; never overwrite an existing key."""
    if not name or "/" in name or name.startswith("."):
        raise KeysError(f"not a usable key name: {name!r}")
    pair = KeyPair(out / f"{name}.key", out / f"{name}.key_secret")
    existing = [str(p) for p in (pair.public, pair.secret) if p.exists()]
    if existing:
        raise KeysError(f"refusing to overwrite {', '.join(existing)}: pick another --name or folder")
    out.mkdir(parents=True, exist_ok=True)
    # The secret file must never exist with wider permissions, not even between write and chmod.
    old_umask = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(out), name)
    finally:
        os.umask(old_umask)
    os.chmod(pair.secret, 0o600)
    os.chmod(pair.public, 0o644)
    return pair
