"""What the service knows about one attached trainer (one ``ServiceLoader``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import Hello

StreamKey = tuple[object, ...]


@dataclass
class Session:
    """A trainer connection, keyed by its ZeroMQ routing id; its batches come from one stream.

    ``credits`` bounds the batches announced to this trainer and not yet released: the service never
    has more than that many of the pool's slots out with it.
    """

    routing_id: bytes
    session_id: str
    hello: Hello
    feed: int
    last_seen: float
    run: int = -1
    epoch: int = 0
    leases: dict[int, tuple[int, int]] = field(default_factory=dict)
    """lease id -> (generation, seq) of the stream batch it names."""
    delivered: int = 0
    evicted: bool = False
    remote: bool = False
    """The trainer cannot map the segment (another host): batches travel as frames over the socket."""
    max_credits: int = 2**31
    """The feed's pool size: credits beyond it are capped."""

    @property
    def client(self) -> str:
        return self.hello.client

    @property
    def credits(self) -> int:
        return min(self.hello.credits, self.max_credits)

    @property
    def mode(self) -> str:
        return self.hello.mode

    @property
    def rank(self) -> int:
        return self.hello.rank if self.mode == "shard" else 0

    @property
    def world_size(self) -> int:
        return self.hello.world_size if self.mode == "shard" else 1

    @property
    def remainder(self) -> str:
        return self.hello.remainder

    @property
    def group(self) -> str:
        return self.hello.group or "default"

    @property
    def group_size(self) -> int:
        return self.hello.group_size

    def stream_key(self) -> StreamKey:
        if self.mode == "broadcast":
            return ("broadcast", self.feed, self.group)
        return ("shard", self.session_id)
