"""``loader-service top``'s side that talks: to the service (one DEALER kept between snapshots) and
to the terminal (keys read without blocking, its settings restored whatever happens). What it shows
is built and drawn in ``loader_service.tools.top``, which is pure."""

from __future__ import annotations

import json
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import zmq
from rich.console import Console
from rich.live import Live

from loader_service.tools.status_view import _endpoint_hint
from loader_service.tools.top import QUIT_KEYS, REFRESH, Frame, Sample, build_frame, lost_frame, render
from protocol.codec import decode, encode
from protocol.curve import ClientKeys
from protocol.messages import ErrorReply, Heartbeat, ProtocolError, StatusReply, StatusRequest
from protocol.printable import printable


class StatusLink:
    """One DEALER to the service, kept between snapshots; made anew after a lost answer."""

    def __init__(self, endpoint: str, server_key: str | None, client_key: str | None) -> None:
        self.endpoint = endpoint
        self._keys = ClientKeys.load(server_key, client_key)  # ValueError naming a bad file
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.apply(sock)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # a malformed endpoint: nothing to keep
            self.close()
            raise ValueError(f"invalid endpoint {self.endpoint!r}: {exc}") from None
        return sock

    def ask(self) -> None:
        self.sock.send(encode(StatusRequest()), zmq.NOBLOCK)

    def take(self) -> Mapping[str, Any] | None:
        """The newest status body waiting, if any; ``RuntimeError`` if the service refused."""
        body = None
        while self.sock.poll(0):
            try:
                msg = decode(self.sock.recv_multipart()[-1], (StatusReply, Heartbeat, ErrorReply))
            except ProtocolError:
                continue
            if isinstance(msg, ErrorReply):
                raise RuntimeError(f"the service at {self.endpoint} refused the request: {msg.message}")
            if isinstance(msg, StatusReply):
                body = msg.body
        return body

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def snapshot(link: StatusLink, timeout: float, fd: int | None = None) -> Sample:
    """Ask and wait; ``TimeoutError`` (the link made anew) if no answer comes within ``timeout``."""
    link.ask()
    body = wait(link, fd, time.monotonic() + timeout, reply=True)
    if body is not None:
        return time.monotonic(), body
    link.sock.close()  # a new connection: no stale request is answered later
    link.sock = link._connect()
    hint = _endpoint_hint(link.endpoint)
    raise TimeoutError(f"no status reply from {link.endpoint} within {timeout:g} s{hint}")


def wait(link: StatusLink, fd: int | None, until: float, reply: bool) -> Mapping[str, Any] | None:
    """Until ``until`` or, if ``reply``, a status body; ``KeyboardInterrupt`` on q read from ``fd``."""
    while (left := until - time.monotonic()) > 0:
        ready = zmq.select([link.sock, *([] if fd is None else [fd])], [], [], left)[0]
        if fd is not None and fd in ready and _quits(fd):
            raise KeyboardInterrupt
        if link.sock in ready and (body := link.take()) is not None and reply:
            return body
    return None


def _quits(fd: int) -> bool:
    try:
        keys = os.read(fd, 64)
    except OSError:  # EIO: the terminal went away, as does an end of file
        return True
    return not keys or any(key in QUIT_KEYS for key in keys)


@contextmanager
def keys_pressed() -> Iterator[int | None]:
    """stdin's descriptor in cbreak mode (keys come one by one, unechoed) for the ``with`` body, its
    settings restored after it whatever happens; ``None`` if stdin is no terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    fd, saved = sys.stdin.fileno(), termios.tcgetattr(sys.stdin.fileno())
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def watch(link: StatusLink, timeout: float, show: Callable[[Frame], None], fd: int | None) -> None:
    """A frame a second until q (``KeyboardInterrupt``); a lost service is shown so and asked again."""
    before: Sample | None = None
    frame: Frame | None = None
    while True:
        started = time.monotonic()
        try:
            now = snapshot(link, timeout, fd)
            frame = build_frame(link.endpoint, now, before)
            before = now
        except (TimeoutError, RuntimeError) as exc:
            frame = lost_frame(link.endpoint, str(exc), frame)
        show(frame)
        wait(link, fd, started + REFRESH, reply=False)


def _console() -> Console:  # 120 columns rather than 80 when printing to no terminal (COLUMNS unset)
    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)


def _live(link: StatusLink, timeout: float) -> None:
    console = _console()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the terminal's settings are restored
        signal.signal(sig, signal.default_int_handler)
    if not console.is_terminal:  # piped: one frame after another, as `top -b` does
        watch(link, timeout, lambda frame: console.print(render(frame), "\n"), None)
        return
    with keys_pressed() as fd, Live(console=console, auto_refresh=False, screen=True) as live:
        watch(link, timeout, lambda frame: live.update(render(frame, "q quits"), refresh=True), fd)


def _once(link: StatusLink, timeout: float, as_json: bool) -> None:
    first = snapshot(link, timeout)
    time.sleep(max(0.0, REFRESH - (time.monotonic() - first[0])))
    frame = build_frame(link.endpoint, snapshot(link, timeout), first)
    if as_json:
        print(json.dumps(frame, indent=2, sort_keys=True))
    else:
        _console().print(render(frame))


def main_top(endpoint: str, once: bool, as_json: bool, timeout: float,
             server_key: str | None = None, client_key: str | None = None) -> int:  # fmt: skip
    """``loader-service top``: 0 on q or Ctrl-C or after ``--once``'s frame; 1 (why on stderr) for a bad
    endpoint or key, or no answer to ``--once``; 130 if ``--once`` is interrupted."""
    try:
        link = StatusLink(endpoint, server_key, client_key)
    except ValueError as exc:
        print(f"loader-service top: {printable(exc)}", file=sys.stderr)
        return 1
    try:
        if once:
            _once(link, timeout, as_json)
        else:
            _live(link, timeout)
    except (TimeoutError, RuntimeError) as exc:
        print(f"loader-service top: {printable(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130 if once else 0
    finally:
        link.close()
    return 0
