"""One thread that keeps every session of a loader alive, however long a training step takes.

A ZeroMQ socket belongs to one thread, so this thread owns one heartbeat socket per session: the
loader's thread only records what should beat (``beat``, ``stop``) and the thread applies it at its
next wake-up. A heartbeat carries the session's token, so it keeps alive only that session, and
the loop's waited and computed totals (NOTE [ Exposed wait ] in gpu_worker/loop_clock.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from curvekeys import ClientKeys
from gpu_worker.loop_clock import LoopClock
from protocol.codec import encode
from protocol.messages import Heartbeat

log = logging.getLogger(__name__)
RETRY = 1.0
"""Seconds before a heartbeat socket that could not be opened is tried again."""


@dataclass(frozen=True)
class Beat:
    endpoint: str
    token: str
    interval: float
    keys: ClientKeys | None


class Heartbeats:
    """``beat(key, ...)`` starts (or replaces) the heartbeats of one session; ``stop(key)`` ends them."""

    def __init__(self, clock: LoopClock | None = None) -> None:
        self._clock = clock or LoopClock()
        self._lock = threading.Lock()
        self._wanted: dict[object, Beat] = {}
        self._changed = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dataferry-heartbeats", daemon=True)
        self._thread.start()

    def beat(self, key: object, endpoint: str, token: str, interval: float, keys: ClientKeys | None) -> None:
        with self._lock:
            self._wanted[key] = Beat(endpoint, token, interval, keys)
        self._changed.set()

    def stop(self, key: object) -> None:
        with self._lock:
            self._wanted.pop(key, None)
        self._changed.set()

    def close(self) -> None:
        self._closing.set()
        self._changed.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        live: dict[object, tuple[Beat, zmq.Socket[bytes], float]] = {}
        try:
            while not self._closing.is_set():
                self._changed.clear()  # before reading: a change made after this wakes the wait below
                with self._lock:
                    wanted = dict(self._wanted)
                _apply(ctx, live, wanted)
                now = time.monotonic()
                for key, (beat, sock, due) in list(live.items()):
                    if now >= due:
                        _send(sock, beat, self._clock)
                        live[key] = (beat, sock, now + beat.interval)
                soonest = min((due for _, _, due in live.values()), default=None)
                if len(live) < len(wanted):  # a socket could not be opened: try again soon
                    soonest = min(soonest or now + RETRY, now + RETRY)
                # Sleeps until the next beat is due; ``beat``, ``stop`` and ``close`` wake it early.
                self._changed.wait(None if soonest is None else max(0.0, soonest - time.monotonic()))
        finally:
            for _, sock, _ in live.values():
                sock.close(linger=0)
            ctx.term()


def _apply(
    ctx: zmq.Context[zmq.Socket[bytes]],
    live: dict[object, tuple[Beat, zmq.Socket[bytes], float]],
    wanted: dict[object, Beat],
) -> None:
    """Open a socket for each new or changed session, close the ones no longer wanted."""
    for key in [key for key, (beat, _, _) in live.items() if wanted.get(key) != beat]:
        live.pop(key)[1].close(linger=0)
    for key, beat in wanted.items():
        if key not in live:
            try:
                sock = ctx.socket(zmq.DEALER)
            except zmq.ZMQError as exc:  # out of descriptors, say: tried again at the next wake-up
                log.warning("cannot open a heartbeat socket to %s: %s", beat.endpoint, exc)
                continue
            sock.setsockopt(zmq.LINGER, 0)
            if beat.keys is not None:
                beat.keys.apply(sock)
            sock.connect(beat.endpoint)
            live[key] = (beat, sock, time.monotonic())


def _send(sock: zmq.Socket[Any], beat: Beat, clock: LoopClock) -> None:
    waited, computed = clock.totals()
    msg = Heartbeat(beat.token, waited=int(waited * 1000), computed=int(computed * 1000), pulls=clock.pulls)
    try:
        sock.send(encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass  # the service is not reading: the next beat tries again
