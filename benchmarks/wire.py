"""(j)'s reference: what pyzmq alone moves over loopback TCP, plain and with CURVE, no dataferry code.

A spawned sender process PUSHes frames of one batch's image bytes (``copy=False`` from one buffer,
as the service sends from a slot); this process PULLs them and drops each at once, as a training loop
lets its batch go. Timed in the same rounds as dataferry's transports, so the ratio of the two says
how much of what ZeroMQ can do here dataferry's protocol, credits and Python keep.

Kept free of torch and of the service's modules: the sender imports only this file.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import zmq
import zmq.auth

from benchmarks.proctree import cpu_seconds
from benchmarks.service_process import BenchError

GB = 1e9
"""Decimal gigabytes, as network figures (and tf.data's 126 MB/s) are quoted."""
SENDER_START_SECONDS = 30.0
"""Allowance for spawning the sender (a fresh interpreter importing zmq) until it has bound."""
ORDER_POLL = 1.0
"""How often a sender waiting for its next order checks that the benchmark is still its parent."""


@dataclass(frozen=True)
class Transfer:
    """One timed transfer: bytes handed to the loop, seconds, and CPU-seconds on each side."""

    nbytes: int
    seconds: float
    sender_cpu: float
    receiver_cpu: float


def loopback_endpoint() -> str:
    """A ``tcp://127.0.0.1`` endpoint on a port that is free now (bound moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@dataclass(frozen=True)
class SenderConfig:
    """What the spawned sender needs: where to bind, the frame size, and its CURVE key pair file."""

    endpoint: str
    frame_bytes: int
    timeout: float
    secret_key: str = ""
    """The server's ``.key_secret`` file; empty for plain TCP."""


def _next_order(orders: Connection, parent: int) -> int:
    """Frames to send next; 0 to stop, also when the benchmark that started this sender is gone."""
    while not orders.poll(ORDER_POLL):
        if os.getppid() != parent:
            return 0
    count: int = orders.recv()
    return count


def sender_main(cfg: SenderConfig, orders: Connection) -> None:
    """Entry point of the spawned sender: bind, then send each ordered count of frames."""
    parent = os.getppid()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if cfg.secret_key:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(cfg.secret_key)
    sock.bind(cfg.endpoint)
    payload = bytearray(os.urandom(cfg.frame_bytes))  # any bytes do: neither TCP nor CURVE looks at them
    orders.send("bound")
    try:
        while (count := _next_order(orders, parent)) > 0:
            trackers = [sock.send(payload, copy=False, track=True) for _ in range(count)]
            for tracker in trackers:
                tracker.wait(cfg.timeout)  # raises if ZeroMQ is not done in time: the parent then fails
            orders.send("sent")
    except (EOFError, BrokenPipeError):
        pass  # the benchmark is gone
    finally:
        sock.close()
        ctx.term()


class RawPair:
    """A PUSH sender in its own process and a PULL receiver here, on a fresh loopback endpoint.

    ``curve``: (the server's ``.key_secret`` file, the client's ``.key_secret`` file), or None for
    plain TCP. No authenticator runs: what is timed is the encryption, as in the service.
    """

    def __init__(self, key: str, nbytes: int, timeout: float, curve: tuple[Path, Path] | None) -> None:
        self.key = key
        self._timeout = timeout
        endpoint = loopback_endpoint()
        spawn = mp.get_context("spawn")
        self._orders, theirs = spawn.Pipe()
        cfg = SenderConfig(endpoint, nbytes, timeout, str(curve[0]) if curve else "")
        self._sender = spawn.Process(target=sender_main, args=(cfg, theirs), name=f"bench-{key}", daemon=True)
        self._sender.start()
        try:
            self._expect("bound", SENDER_START_SECONDS)
        except BaseException:
            self._sender.kill()  # not yet anybody's to close
            self._sender.join(5)
            raise
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self._sock.curve_serverkey = zmq.auth.load_certificate(curve[0])[0]
            public, secret = zmq.auth.load_certificate(curve[1])
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret or b""
        self._sock.connect(endpoint)

    def _expect(self, word: str, timeout: float) -> None:
        if not self._orders.poll(timeout) or self._orders.recv() != word:
            raise BenchError(
                f"{self.key}: the sender (pid {self._sender.pid}) did not answer {word!r} in time"
            )

    def warm(self, count: int) -> None:
        self.transfer(count)  # untimed: the connection's first buffers and handshake

    def prepare(self, count: int) -> None:
        """Nothing to wait for: the sender's frame is always ready."""

    def transfer(self, count: int) -> Transfer:
        """``count`` frames from the order to the last one received, each dropped as it arrives."""
        sender, receiver = [self._sender.pid or 0], [os.getpid()]
        sender_before, receiver_before = cpu_seconds(sender), cpu_seconds(receiver)
        start = time.perf_counter()
        self._orders.send(count)
        nbytes = 0
        for _ in range(count):
            if not self._sock.poll(int(self._timeout * 1000)):
                raise BenchError(f"{self.key}: no frame from the sender within {self._timeout:.0f} s")
            nbytes += len(self._sock.recv(copy=False))
        seconds = time.perf_counter() - start
        receiver_cpu = cpu_seconds(receiver) - receiver_before
        sender_cpu = cpu_seconds(sender) - sender_before
        self._expect("sent", self._timeout)
        return Transfer(nbytes, seconds, sender_cpu, receiver_cpu)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._orders.send(0)
        self._sender.join(5)
        if self._sender.is_alive():
            self._sender.kill()
            self._sender.join(5)
        self._sock.close()
        self._ctx.term()
