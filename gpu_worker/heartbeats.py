"""One thread that keeps every session of a loader alive, however long a training step takes.

A ZeroMQ socket belongs to one thread, so this thread owns one heartbeat socket per session: the
loader's thread only records what should beat (``beat``, ``stop``) and the thread applies it at its
next wake-up. A heartbeat carries the session's token, so it keeps alive only that session, and
the loop's waited and computed totals (NOTE [ Exposed wait ] in gpu_worker/loop_clock.py) and the
share of rows it decodes itself.

NOTE [ Early heartbeat ]
    A session's first heartbeat goes at once, its second ``EARLY`` seconds later (or at the interval,
    if that is shorter), then one every interval. The first carries no wait of this session yet; the
    second tells the service whether a trainer that just attached is waiting, so an idle service
    sizes its workers for it within a second instead of a whole interval later (NOTE [ Sizing
    workers ] in loader_service/supervisor/workers/sizing/rule.py). One extra message per session,
    not per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from gpu_worker.loop_clock import LoopClock
from protocol.codec import encode
from protocol.curve import ClientKeys
from protocol.messages import Heartbeat

log = logging.getLogger(__name__)
RETRY = 1.0
"""Seconds before a heartbeat socket that could not be opened is tried again."""
EARLY = 0.25
"""Seconds after a session's first heartbeat that its second goes (NOTE [ Early heartbeat ])."""


@dataclass(frozen=True)
class Beat:
    endpoint: str
    token: str
    interval: float
    keys: ClientKeys | None


@dataclass
class _Live:
    """A session's open heartbeat socket, when its next beat is due and how many it has sent."""

    beat: Beat
    sock: zmq.Socket[bytes]
    due: float
    sent: int = 0


class Heartbeats:
    """``beat(key, ...)`` starts (or replaces) the heartbeats of one session; ``stop(key)`` ends them."""

    def __init__(self, clock: LoopClock | None = None, share: Callable[[], int] = lambda: -1) -> None:
        """``share``: the thousandths of its rows the loader decodes itself now, -1 for none (NOTE
        [ Finding the split ] in gpu_worker/split.py), carried by every beat."""
        self._clock = clock or LoopClock()
        self._share = share
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
        live: dict[object, _Live] = {}
        try:
            while not self._closing.is_set():
                self._changed.clear()  # before reading: a change made after this wakes the wait below
                with self._lock:
                    wanted = dict(self._wanted)
                _apply(ctx, live, wanted)
                now = time.monotonic()
                for one in live.values():
                    if now >= one.due:
                        _send(one.sock, one.beat, self._clock, self._share())
                        one.sent += 1
                        # NOTE [ Early heartbeat ]: the second beat a quarter second after the first.
                        one.due = now + (
                            min(EARLY, one.beat.interval) if one.sent == 1 else one.beat.interval
                        )
                soonest = min((one.due for one in live.values()), default=None)
                if len(live) < len(wanted):  # a socket could not be opened: try again soon
                    soonest = min(soonest or now + RETRY, now + RETRY)
                # Sleeps until the next beat is due; ``beat``, ``stop`` and ``close`` wake it early.
                self._changed.wait(None if soonest is None else max(0.0, soonest - time.monotonic()))
        finally:
            for one in live.values():
                one.sock.close(linger=0)
            ctx.term()


def _apply(
    ctx: zmq.Context[zmq.Socket[bytes]],
    live: dict[object, _Live],
    wanted: dict[object, Beat],
) -> None:
    """Open a socket for each new or changed session, close the ones no longer wanted."""
    for key in [key for key, one in live.items() if wanted.get(key) != one.beat]:
        live.pop(key).sock.close(linger=0)
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
            live[key] = _Live(beat, sock, time.monotonic())


def _send(sock: zmq.Socket[Any], beat: Beat, clock: LoopClock, share: int) -> None:
    waited, computed = clock.totals()
    millis = {"waited": int(waited * 1000), "computed": int(computed * 1000)}
    msg = Heartbeat(beat.token, **millis, pulls=clock.pulls, encode=share)
    try:
        sock.send(encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass  # the service is not reading: the next beat tries again
