"""Who a service is before a trainer believes it: the process behind an ipc socket, the owner of a pool.

NOTE [ A service's identity ]
    On one host the ZeroMQ handshake proves nothing: any local user who can bind an ``ipc://`` path
    first, or create a ``dataferry-*`` segment, could feed a trainer batches of their own or shrink
    a segment the trainer maps (a SIGBUS inside torch). So on every attach, not only for a private
    service:
    * an ``ipc://`` endpoint's listener is asked for its credentials (``SO_PEERCRED`` of a plain
      connection to the path, made when the welcome has arrived, so it names the process that
      answered, not one that bound the path earlier). It is trusted when it runs as this user or
      as root, or as the user who owns the socket's folder when nobody else may write in that
      folder (``/run/dataferry``, 0750, owned by the service's user). A listener in a folder others
      can write in (the shared temp folder) running as someone else is refused: anyone could have
      bound that path;
    * a segment is mapped only if it is a regular file owned by the service's user (an ipc peer's
      uid as above; over TCP, where no credentials travel, this user or root) that other users
      cannot open (no ``o`` bits; ``g`` bits are the trainers' group, NOTE [ Shared-memory cleanup ]).
      Over TCP CURVE proves the server's key; a pool that fails the check is read over the socket
      instead (``transport="auto"``) or refused.
    ``ServiceLoader.local`` adds what only a parent can know: its socket sits in a 0700 folder made
    before the child starts, readiness arrives on a socket pair only the parent holds, and the
    listener must be the very child it started (NOTE [ A private service ] in gpu_worker/local.py).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass

PROBE_TIMEOUT = 1.0
"""Seconds to connect to the listener for its credentials: a local socket answers at once."""
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Credentials:
    """The process listening on a unix socket, as the kernel saw it when it called ``listen``."""

    pid: int
    uid: int
    gid: int


def ipc_path(endpoint: str) -> str | None:
    """The socket path of an ``ipc://`` endpoint; None for any other transport."""
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def listener_of(path: str) -> Credentials:
    """The credentials of whoever listens on ``path``; OSError if nobody does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT)
        probe.connect(path)
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Credentials(*_UCRED.unpack(raw))


def _folder_is_theirs(path: str, uid: int) -> bool:
    """``uid`` owns the socket's folder and nobody else may create or replace names in it."""
    folder = os.stat(os.path.dirname(os.path.abspath(path)))
    return folder.st_uid == uid and not folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted_listener(uid: int, path: str) -> bool:
    """NOTE [ A service's identity ]: may a listener running as ``uid`` on ``path`` be believed?"""
    return uid in (os.geteuid(), 0) or _folder_is_theirs(path, uid)


def check_listener(endpoint: str) -> Credentials | None:
    """The credentials of the service behind an ``ipc://`` endpoint, checked (NOTE [ A service's
    identity ]); None for other transports. ValueError naming the user when it is not to be
    trusted or cannot be asked."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        peer = listener_of(path)
        trusted = trusted_listener(peer.uid, path)
    except OSError as exc:
        raise ValueError(f"cannot tell who listens on {endpoint} ({exc}); not trusting it") from None
    if not trusted:
        raise ValueError(
            f"the process listening on {endpoint} (pid {peer.pid}) runs as uid {peer.uid}, neither this "
            f"user ({os.geteuid()}) nor root nor the owner of a folder only its owner can write in: "
            "anyone could have bound that path. Put the socket in a folder the service's user owns "
            "(RuntimeDirectory=, mode 0750) (NOTE [ A service's identity ])"
        )
    return peer


def check_segment(fd: int, name: str, owner: int | None) -> None:
    """Refuse to map a segment another user could have made or could shrink (NOTE [ A service's
    identity ]): ``owner`` is the service's uid where known (an ipc peer), else this user or root
    must own it. ValueError saying why."""
    seen = os.fstat(fd)
    allowed = (owner,) if owner is not None else (os.geteuid(), 0)
    if not stat.S_ISREG(seen.st_mode):
        raise ValueError(f"segment {name} is not a regular file")
    if seen.st_uid not in allowed:
        whose = f"the service's uid {owner}" if owner is not None else f"this user ({os.geteuid()}) or root"
        raise ValueError(f"segment {name} is owned by uid {seen.st_uid}, not {whose}")
    if seen.st_mode & stat.S_IRWXO:
        raise ValueError(f"segment {name} is open to every user (mode {stat.S_IMODE(seen.st_mode):o})")
