"""Claiming and releasing an ipc:// endpoint path safely."""

from __future__ import annotations

import os
import socket


class EndpointInUse(RuntimeError):
    pass


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def claim_ipc_path(endpoint: str) -> None:
    """Refuse an ipc endpoint another live service listens on; remove a stale socket file.

    A second ZeroMQ bind to the same path silently steals it from the first service.
    """
    path = ipc_path(endpoint)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left behind by a service that died
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise EndpointInUse(f"another process is already listening on {endpoint}")


def release_ipc_path(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
