"""A TCP proxy that does to a connection what networks do: delay it, cap it, stall it, reset it.

The faults TCP really has, modelled on toxiproxy's: latency (every chunk is held for a fixed time
each way), a bandwidth cap (a token bucket each way), a stall (nothing is read or written, so bytes
pile up in the kernels' buffers and arrive, in order, once it ends) and a reset (both sides closed
with ``SO_LINGER`` 0, so each gets an RST and whatever was buffered is discarded). It never drops
bytes from a connection that stays up: TCP does not either.

Faults can be scheduled by the bytes forwarded from the server (``reset_every``, ``stall_at``), so a
test can say "reset every two batches" without watching the trainer. Used by the network tests
(``tests/integration/test_network.py``) and benchmark scenario (l).

    proxy = FaultProxy(("127.0.0.1", service_port))
    proxy.start()                       # listens on 127.0.0.1:proxy.port
    proxy.faults.latency = 0.05         # 50 ms each way
    proxy.reset()                       # every connection now, both sides
    proxy.close()
"""

from __future__ import annotations

import contextlib
import multiprocessing
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

CHUNK = 256 * 1024
MAX_BUFFERED = 64 * 1024 * 1024
"""Bytes held per direction before the proxy stops reading (TCP back-pressure, as a router's queue).
With ``latency`` it caps what one direction carries at MAX_BUFFERED / latency: 8 MiB held 50 ms
capped (l) at 160 MB/s, which measured the proxy, not the protocol; 64 MiB leaves 1.3 GB/s."""
TICK = 0.002


@dataclass
class Faults:
    """What the proxy does now; change any field at any time."""

    latency: float = 0.0
    """Seconds every chunk is held, each way."""
    bandwidth: float = 0.0
    """Bytes a second each way (0: no cap)."""
    reset_every: int = 0
    """Reset every connection each time this many more bytes came from the server (0: never)."""
    stall_at: list[tuple[int, float]] = field(default_factory=list)
    """(bytes from the server, seconds): stall everything for that long once that many have passed."""
    hold_from_server: bool = False
    """Read what the server sends but pass none of it on (the client's messages still go through):
    announcements pile up in flight, for a reset to lose."""
    hold_from_client: bool = False
    """The same the other way: a trainer's releases pile up in flight."""


@dataclass
class _Direction:
    src: socket.socket
    dst: socket.socket
    from_server: bool
    queue: deque[tuple[float, memoryview]] = field(default_factory=deque)
    buffered: int = 0
    read_while_held: int = 0
    tokens: float = 0.0
    refilled: float = field(default_factory=time.monotonic)
    eof: bool = False

    def refill(self, rate: float, now: float) -> None:
        """The bandwidth cap's token bucket: ``rate`` bytes a second, bursts of 10 ms."""
        self.tokens = min(self.tokens + (now - self.refilled) * rate, max(rate * 0.01, 64 * 1024))
        self.refilled = now


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    ways: tuple[_Direction, _Direction]


@dataclass
class Counters:
    connections: int = 0
    resets: int = 0
    stalls: int = 0
    from_server: int = 0
    from_client: int = 0


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream`` on its own thread, with ``faults`` applied."""

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self.faults = Faults()
        self.counters = Counters()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._links: list[_Link] = []
        self._stalled_until = 0.0
        self._lock = threading.Lock()
        self._resets_wanted = 0
        self._resets_done = threading.Condition(self._lock)
        self._next_reset_at = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._next_reset_at = self.faults.reset_every
        self._thread.start()
        return self

    def wait(self) -> None:
        """Block while the proxy runs (a process that exists only to run it)."""
        self._thread.join()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for link in self._links:
            _abort(link.client)
            _abort(link.server)
        self._links.clear()
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- faults on demand -------------------------------------------------------------------

    def reset(self, timeout: float = 5.0) -> None:
        """Reset every open connection (RST both ways, buffers discarded); returns once done."""
        with self._lock:
            self._resets_wanted += 1
            wanted = self._resets_wanted
            if not self._resets_done.wait_for(lambda: self.counters.resets >= wanted, timeout):
                raise TimeoutError("the proxy did not reset within the timeout")

    def stall(self, seconds: float) -> None:
        """Forward nothing for ``seconds`` (bytes wait in the kernels' buffers, none is lost)."""
        with self._lock:
            self._stalled_until = max(self._stalled_until, time.monotonic() + seconds)
            self.counters.stalls += 1

    def held_from_clients(self) -> list[int]:
        """Bytes each open connection's client sent while ``hold_from_client`` was on (and so still
        holds), in order of connection."""
        return [link.ways[0].read_while_held for link in list(self._links)]

    @property
    def stalled(self) -> bool:
        return time.monotonic() < self._stalled_until

    # --- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scheduled_faults()
            if self._resets_wanted > self.counters.resets:
                self._reset_all()
            stalled = self.stalled
            readable = [] if stalled else self._readable()
            writable = [] if stalled else self._writable()
            try:
                r, w, _ = select.select([self._listener, *readable], writable, [], TICK)
            except (OSError, ValueError):
                self._drop_closed()
                continue
            if self._listener in r:
                self._accept()
            if not stalled:
                self._pump(set(r), set(w))
            self._drop_closed()

    def _scheduled_faults(self) -> None:
        f = self.faults
        sent = self.counters.from_server
        if f.reset_every and sent >= self._next_reset_at:
            self._next_reset_at = sent + f.reset_every
            if self._links:
                with self._lock:
                    self._resets_wanted += 1
        due = [s for s in f.stall_at if sent >= s[0]]
        for item in due:
            f.stall_at.remove(item)
            self.stall(item[1])

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        server = socket.socket()
        try:
            server.settimeout(2.0)
            server.connect(self.upstream)
        except OSError:
            _abort(client)
            _abort(server)
            return
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ways = (_Direction(client, server, False), _Direction(server, client, True))
        self._links.append(_Link(client, server, ways))
        self.counters.connections += 1

    def _directions(self) -> list[_Direction]:
        return [way for link in self._links for way in link.ways]

    def _readable(self) -> list[socket.socket]:
        return [d.src for d in self._directions() if not d.eof and d.buffered < MAX_BUFFERED]

    def _writable(self) -> list[socket.socket]:
        now, rate = time.monotonic(), self.faults.bandwidth
        out = []
        for d in self._directions():
            if rate:
                d.refill(rate, now)
            if d.queue and d.queue[0][0] <= now and (not rate or d.tokens >= 1) and not self._held(d):
                out.append(d.dst)
        return out

    def _pump(self, readable: set[socket.socket], writable: set[socket.socket]) -> None:
        now = time.monotonic()
        for d in self._directions():
            if d.src in readable and not d.eof:
                self._read(d, now)
            if d.dst in writable:
                self._write(d, now)

    def _read(self, d: _Direction, now: float) -> None:
        try:
            data = d.src.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            self._close_link_of(d)
            return
        if not data:
            d.eof = True
            return
        d.queue.append((now + self.faults.latency, memoryview(data)))
        d.buffered += len(data)
        if self._held(d):
            d.read_while_held += len(data)

    def _held(self, d: _Direction) -> bool:
        return self.faults.hold_from_server if d.from_server else self.faults.hold_from_client

    def _write(self, d: _Direction, now: float) -> None:
        if self._held(d):  # checked again: a hold may begin between the select and the write
            return
        rate = self.faults.bandwidth
        while d.queue and d.queue[0][0] <= now:
            due, chunk = d.queue[0]
            budget = min(len(chunk), int(d.tokens)) if rate else len(chunk)
            if budget <= 0:
                return
            try:
                n = d.dst.send(chunk[:budget])
            except BlockingIOError:
                return
            except OSError:
                self._close_link_of(d)
                return
            if rate:
                d.tokens -= n
            d.buffered -= n
            self._count(d, n)
            if n < len(chunk):
                d.queue[0] = (due, chunk[n:])
                return
            d.queue.popleft()

    def _count(self, d: _Direction, n: int) -> None:
        if d.from_server:
            self.counters.from_server += n
        else:
            self.counters.from_client += n

    def _close_link_of(self, d: _Direction) -> None:
        for link in self._links:
            if d in link.ways:
                _abort(link.client)
                _abort(link.server)

    def _reset_all(self) -> None:
        for link in self._links:
            _abort(link.client)
            _abort(link.server)
        self._links.clear()
        with self._lock:
            self.counters.resets = self._resets_wanted
            self._resets_done.notify_all()

    def _drop_closed(self) -> None:
        keep = []
        for link in self._links:
            if link.client.fileno() < 0 or link.server.fileno() < 0:
                _abort(link.client)
                _abort(link.server)
            elif any(d.eof and not d.queue for d in link.ways):  # one side closed: pass it on
                link.client.close()
                link.server.close()
            else:
                keep.append(link)
        self._links = keep


def _abort(sock: socket.socket) -> None:
    """Close with an RST, discarding unsent data: SO_LINGER on, timeout 0."""
    if sock.fileno() < 0:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _serve_in_child(upstream: tuple[str, int], latency: float, port: Connection) -> None:
    """A child process's proxy: reports its port, then forwards until the parent ends it."""
    proxy = FaultProxy(upstream)
    proxy.faults.latency = latency
    proxy.start()
    port.send(proxy.port)
    port.close()
    proxy.wait()


@contextlib.contextmanager
def proxy_process(upstream: tuple[str, int], latency: float) -> Iterator[str]:
    """A delaying proxy in a process of its own (its endpoint while the ``with`` lasts), so that
    what it costs to forward does not share a GIL with the trainer it serves (benchmark (l))."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve_in_child, args=(upstream, latency, child), daemon=True)
    process.start()
    try:
        if not parent.poll(30):
            raise TimeoutError("the proxy process did not start")
        yield f"tcp://127.0.0.1:{parent.recv()}"
    finally:
        process.terminate()
        process.join(5)
