"""sd_notify for a ``Type=notify`` unit, in a few lines and without a dependency.

systemd passes the path of an AF_UNIX datagram socket in ``$NOTIFY_SOCKET`` (a leading ``@`` names the
abstract namespace) and, when ``WatchdogSec=`` is set, the interval in ``$WATCHDOG_USEC`` (and the pid
it is meant for in ``$WATCHDOG_PID``). Each notification is one datagram of ``KEY=VALUE`` lines:

    READY=1        the slots exist and the endpoint listens (``ready``)
    STATUS=...     one line shown by ``systemctl status`` (``status``)
    WATCHDOG=1     the supervisor loop is alive; due every half interval (``Watchdog``)
    STOPPING=1     shutdown has begun (``stopping``)

Outside systemd ``$NOTIFY_SOCKET`` is unset and every call is a no-op returning False. A failed send
is logged at debug level and returns False: notifications never stop the service.

A trainer's private service (``ServiceLoader.local``) gets the same lines on an inherited socket
instead, its descriptor in ``$DATAFERRY_NOTIFY_FD``: only the parent holds the other end, where a
named socket could be bound or written to by another local user (NOTE [ A private service ] in
gpu_worker/local.py). Sends to it never wait: a parent that stopped reading costs nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)
SEND_TIMEOUT = 1.0  # seconds; a datagram to a live systemd never waits, a wedged one must not hang us


NOTIFY_FD_ENV = "DATAFERRY_NOTIFY_FD"


def notify(state: str) -> bool:
    """Send ``state`` to ``$NOTIFY_SOCKET`` and to the inherited ``$DATAFERRY_NOTIFY_FD``; False when
    neither is set, or every send failed."""
    sent = _notify_fd(state)
    return _notify_socket(state) or sent


def _notify_fd(state: str) -> bool:
    fd_text = os.environ.get(NOTIFY_FD_ENV, "")
    if not fd_text.isdigit():
        return False
    try:
        fd = int(fd_text)
        os.set_inheritable(fd, False)  # the parent's channel, not the decode workers'
        with socket.socket(fileno=os.dup(fd)) as channel:
            channel.send(state.encode(), socket.MSG_DONTWAIT)
    except OSError as exc:
        log.debug("notify on fd %s failed: %s", fd_text, exc)
        return False
    return True


def _notify_socket(state: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):  # unset, or a vsock: address, which we do not speak
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.connect(address)
            sock.send(state.encode())
    except OSError as exc:
        log.debug("sd_notify to %r failed: %s", address, exc)
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())


def ready(status: str = "") -> bool:
    """``READY=1`` (with a ``STATUS=`` line when given): call once the service accepts trainers."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def status(text: str) -> bool:
    """``STATUS=``: the one-line summary ``systemctl status`` shows."""
    return notify(f"STATUS={_one_line(text)}")


def stopping() -> bool:
    """``STOPPING=1``: call when a stop signal is acted on, before workers are joined."""
    return notify("STOPPING=1")


class Watchdog:
    """``WATCHDOG=1`` pings at half of ``WatchdogSec=``, sent by the main loop while it is healthy.

    Built from the environment systemd gives the main process: ``WATCHDOG_USEC`` (the interval) and,
    when set, ``WATCHDOG_PID``, which must be this process (a child that inherited the variables does
    not ping). Disabled, and ``due`` always False, when either says the watchdog is not ours.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self._interval = int(usec) / 2e6 if ours else None
        self._last_ping: float | None = None

    @property
    def enabled(self) -> bool:
        return self._interval is not None

    @property
    def interval(self) -> float | None:
        """Seconds between pings (half of ``WatchdogSec=``), None when disabled."""
        return self._interval

    def due(self, now: float) -> bool:
        """Is a ping due at ``now`` (``time.monotonic()``)? True at once for the first one."""
        if self._interval is None:
            return False
        return self._last_ping is None or now - self._last_ping >= self._interval

    def ping(self, now: float) -> bool:
        """Send ``WATCHDOG=1`` and remember ``now`` as the time of the last ping."""
        self._last_ping = now
        return notify("WATCHDOG=1")
