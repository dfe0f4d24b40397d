"""Who a service is before a trainer believes it: the process behind an ipc socket, the owner of a pool.

NOTE [ A service's identity ]
    On one host the ZeroMQ handshake proves nothing: any local user who can bind an ``ipc://`` path
    first, or create a ``dataferry-*`` segment, could feed a trainer batches of their own or shrink
    a segment the trainer maps (a SIGBUS inside torch). So on every attach, not only for a private
    service:
    * an ``ipc://`` endpoint's listener is known by the credentials of the very connection its
      welcome came on (``SO_PEERCRED``, which libzmq reads when it connects and hands on with each
      message as its ``Peer-Address``), not by a second connection to the path: a link swapped
      after the connect would send that one elsewhere (a review's did, to a listener of root's, and
      the trainer took another user's batches). It is trusted when it runs as this user or as root.
      Another user is trusted only where nobody but that user and root could have put a listener:
      the socket file and its folder are that user's, every folder above is theirs or root's, no
      folder on the way is open to other users' writes and none of it is a symbolic link. So
      ``/run/dataferry`` (``RuntimeDirectory=``: made by root in root's ``/run``, owned by the
      service's user, 0750) passes; a folder that user made in ``/tmp`` does not, since anyone may
      have made it first (a review's ``nobody`` made one, 0755, and the trainer took its batches).
      The session then believes only that process: libzmq reconnects a socket by itself, without a
      welcome, to whoever binds the path next (a review's ``nobody`` did, in /tmp, after this user's
      service died, and the trainer took its heartbeats and a batch naming a slot of the old pool),
      so a message whose credentials are not the welcome's ends the session and its next hello's
      welcome is checked afresh;
    * a segment is mapped only if it is a regular file owned by the service's user (the ipc peer's
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
    """The credentials of whoever listens on ``path`` now; OSError if nobody does. Only for a path in
    a folder of this user's alone (``ServiceLoader.local``'s): elsewhere a name may have changed since
    a connection was made, and ``peer_credentials`` of that connection's messages is the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT)
        probe.connect(path)
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Credentials(*_UCRED.unpack(raw))


def peer_credentials(peer_address: str) -> Credentials | None:
    """The listener's credentials from an ipc message's ``Peer-Address`` (``host:uid:gid:pid``, the
    ``SO_PEERCRED`` libzmq read of the connection it came on); None where they are not there."""
    _, *numbers = peer_address.rsplit(":", 3)
    if len(numbers) != 3 or not all(n.isdigit() for n in numbers):
        return None
    uid, gid, pid = map(int, numbers)
    return Credentials(pid, uid, gid)


def _only_theirs(path: str, uid: int) -> bool:
    """Could nobody but ``uid`` and root have bound ``path``? The socket and its folder are
    ``uid``'s; every folder up to ``/`` is ``uid``'s or root's and closed to other users' writes;
    nothing on the way is a symbolic link (NOTE [ A service's identity ])."""
    path = os.path.abspath(path)
    if ".." in path.split(os.sep):
        return False  # resolved through what the names before it are: not checked here
    seen = os.lstat(path)
    folder = os.path.dirname(path)
    if not stat.S_ISSOCK(seen.st_mode) or seen.st_uid != uid or os.lstat(folder).st_uid != uid:
        return False
    while True:
        seen = os.lstat(folder)
        closed = not seen.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if not stat.S_ISDIR(seen.st_mode) or seen.st_uid not in (uid, 0) or not closed:
            return False
        if folder == os.path.dirname(folder):
            return True
        folder = os.path.dirname(folder)


def trusted_listener(uid: int, path: str) -> bool:
    """NOTE [ A service's identity ]: may a listener running as ``uid`` on ``path`` be believed?"""
    return uid in (os.geteuid(), 0) or _only_theirs(path, uid)


def check_listener(endpoint: str, peer: Credentials | None) -> Credentials | None:
    """``peer``, the credentials of the connection a service's welcome came on, checked for an
    ``ipc://`` endpoint (NOTE [ A service's identity ]); None for other transports. ValueError
    naming the user when it is not to be trusted or cannot be told."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    if peer is None:
        raise ValueError(
            f"cannot tell who listens on {endpoint} (no credentials came with its welcome); not trusting it"
        )
    try:
        trusted = trusted_listener(peer.uid, path)
    except OSError as exc:
        raise ValueError(f"cannot check who may bind {path} ({exc}); not trusting it") from None
    if not trusted:
        raise ValueError(
            f"the process listening on {endpoint} (pid {peer.pid}) runs as uid {peer.uid}, neither this "
            f"user ({os.geteuid()}) nor root, and that path is not one only that user and root could "
            "have bound (the socket and its folder theirs, every folder above theirs or root's, none "
            "open to others' writes, no symbolic link): anyone could have bound it. Put the socket in "
            "the service user's runtime folder (RuntimeDirectory=, mode 0750) and name it by its real "
            "path (NOTE [ A service's identity ])"
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
