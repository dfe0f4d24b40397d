"""What the service knows about one attached trainer (one ``ServiceLoader``)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from loader_service.supervisor.trainers.load import TrainerLoop
from loader_service.supervisor.trainers.sends import Send
from protocol.messages import BatchReady, Hello

StreamKey = tuple[object, ...]


@dataclass
class Leased:
    """A batch announced to a session and not yet released (NOTE [ Acknowledged delivery ])."""

    key: tuple[int, int]
    """(generation, seq) of the stream batch it names."""
    announced: BatchReady
    """The announcement as sent, to send again if the trainer says it never arrived."""
    send: Send
    """Its latest copy's way out (NOTE [ Remote sends ]); always done for a local trainer."""
    resent_at: float = float("-inf")


@dataclass
class Session:
    """A trainer connection, keyed by its ZeroMQ routing id; its batches come from one stream.

    ``credits`` bounds the batches announced to this trainer and not yet released: the service never
    has more than that many of the pool's slots out with it. ``session_id`` is a public label for
    logs and status; ``token`` is the secret every message of the session must carry.
    """

    routing_id: bytes
    session_id: str
    hello: Hello
    feed: int
    last_seen: float
    run: int = -1
    epoch: int = 0
    leases: dict[int, Leased] = field(default_factory=dict)
    """lease id -> the batch it names. Ids count 1, 2, 3, ... per session in announcement order."""
    next_lease: int = 1
    delivered: int = 0
    resent: int = 0
    """Announcements sent again because the trainer said they never arrived."""
    recovered: int = 0
    """Leases freed because the trainer's acknowledgement showed their release was lost."""
    evicted: bool = False
    remote: bool = False
    """The trainer cannot map the segment (another host): batches travel as frames over the socket."""
    max_credits: int = 2**31
    """The feed's pool size: credits beyond it are capped."""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    opened_by: Hello | None = None
    """The hello that opened or last resumed the session: the same one again is a repeat."""
    loop: TrainerLoop = field(default_factory=TrainerLoop)
    served: npt.NDArray[np.int64] | None = None
    """Rows announced to it by source, for a feed of several (NOTE [ Source ledger ])."""
    """The trainer loop's waits, compute and pulls from its heartbeats, and what the service saw of
    them (NOTE [ Fleet load ], NOTE [ Sizing workers ])."""

    def presents(self, token: str) -> bool:
        """Is ``token`` this session's? Compared in constant time."""
        return hmac.compare_digest(token.encode(), self.token.encode())

    @property
    def sent(self) -> int:
        """The last lease id announced to this session (0: none yet)."""
        return self.next_lease - 1

    @property
    def client(self) -> str:
        """The trainer's self-description, made safe for a log line or a terminal."""
        return printable(self.hello.client)

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
            return group_key(self.feed, self.group, self.hello.group_secret)
        return ("shard", self.session_id)


def group_key(feed: int, group: str, secret: str) -> StreamKey:
    """A broadcast group is its name among the trainers that share its secret; the key holds a
    digest of the secret, never the secret."""
    return ("broadcast", feed, group or "default", hashlib.sha256(secret.encode()).hexdigest()[:32])


def printable(text: str) -> str:
    """``text`` with every character that could break a log line or drive a terminal escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
