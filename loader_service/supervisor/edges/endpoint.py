"""The trainers' endpoint: its ipc path claimed and released safely, the ROUTER socket bound with CURVE
or the warning its absence calls for, and messages read from it within bounds."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import zmq

from loader_service.config import ServiceConfig
from loader_service.shm import restrict
from loader_service.supervisor.edges.curve import CurveGuard
from protocol.curve import is_loopback
from protocol.messages import MAX_FRAME_BYTES

log = logging.getLogger(__name__)
Socket = zmq.Socket[Any]
MAX_PARTS = 3
"""A routing id and one message frame, plus one part to tell a longer message apart."""


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


def bind_trainer_endpoint(ctx: zmq.Context[Socket], cfg: ServiceConfig) -> tuple[Socket, CurveGuard | None]:
    """The ROUTER socket trainers attach to, bound to ``cfg.endpoint``, and its CURVE guard if any."""
    claim_ipc_path(cfg.endpoint)
    sock = ctx.socket(zmq.ROUTER)
    guard = None
    if cfg.curve_secret_key:
        guard = CurveGuard(ctx, Path(cfg.curve_secret_key), Path(cfg.curve_authorized))
        guard.secure(sock)
    elif cfg.endpoint.startswith("tcp://"):
        reach = "every user of this host" if is_loopback(cfg.endpoint) else "other hosts"
        log.warning(
            "%s is open to %s WITHOUT authentication or encryption (--insecure-tcp): "
            "anyone who reaches it can attach; see docs/trainers.md, Trainers on other hosts",
            cfg.endpoint,
            reach,
        )
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A trainer whose connection died without the service seeing it (a NAT that forgot the flow)
    # reconnects under the same routing id: the new connection takes over the old one's place
    # instead of being ignored while the dead one lingers (NOTE [ Acknowledged delivery ]).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    path = ipc_path(cfg.endpoint)
    # The socket file is made with the umask's mode: closed to all but the owner from its first
    # moment, then opened to the group (if any) by ``restrict``.
    umask = os.umask(0o077)
    try:
        sock.bind(cfg.endpoint)
    finally:
        os.umask(umask)
    if path is not None:
        restrict(path, cfg.group)  # only the service's user (and group) may connect
    return sock, guard


def recv_bounded(sock: Socket) -> list[bytes]:
    """One multipart message, keeping at most ``MAX_PARTS`` parts; the rest are received as frames
    and dropped at once, so a peer cannot make the loop hold a long message in Python."""
    parts = [sock.recv(zmq.NOBLOCK)]
    while sock.getsockopt(zmq.RCVMORE):
        if len(parts) < MAX_PARTS:
            parts.append(sock.recv())
        else:
            sock.recv(copy=False)
    return parts
