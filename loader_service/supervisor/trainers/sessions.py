"""What the service knows about one attached trainer (one ``ServiceLoader``).

NOTE [ Credits per session ]
    A session's credits are the batches it may hold, and so the slots of its feed's pool: one that
    asks many could hold them all, and other trainers would wait for slots it never gives back (a
    peer that asked 1024 credits and released nothing grew a pool from 8 slots to 130, and another
    trainer got no batch for a minute). So a session is granted at most ``credit_cap(reach)``
    credits, ``reach`` being the slots its feed's pool may have when it says hello: those it has
    and what /dev/shm holds above its floor (NOTE [ A /dev/shm floor ] in loader_service/shm.py),
    at most ``--slots`` (automatic: 256, or 2 x the most workers + 8). That is
    * half of ``reach``, so that the others keep as many (128 of an automatic pool's 256);
    * or a trainer's default 6 credits, where that is more (a pool of 8 still gives a trainer 6),
    * but one slot always stays for the others, and every session gets at least 2: a trainer's
      loop holds one batch while the next one comes (a pool of 2 slots cannot be shared).
    The welcome says what was granted (``credits``: a trainer's loader keeps to it), the grant is
    logged where it is less than what was asked, ``status`` shows both for each session
    (``credits``, ``credits_asked``) and, for each feed, what a session attaching now would get
    (``credits_most``). The cap is per session: the ranks of a DDP job are a session each and share
    the pool as any sessions do (the scheduler serves the one with the fewest batches in flight
    first); the members of a broadcast group hold the same batches, so a group holds its smallest
    grant's worth of slots. A peer that opens several sessions holds several shares: who may
    attach at all (the socket's permissions, CURVE keys) and ``--max-sessions`` bound that, and the
    floor keeps /dev/shm for the host's other users whatever the sessions hold.
"""

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
from protocol.printable import printable

StreamKey = tuple[object, ...]
SHARE_LEAST = 6
"""Credits a session is granted whatever its share, where the pool can spare them: a trainer's
default (``Hello.credits``, ``ServiceLoader(credits=6)``)."""


def credit_cap(reach: int) -> int:
    """The most credits a session is granted on a pool that may have ``reach`` slots (NOTE
    [ Credits per session ])."""
    return max(2, min(reach - 1, max(reach // 2, SHARE_LEAST)))


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
    """Credits beyond this are not granted (NOTE [ Credits per session ])."""
    pinned_through: int = 0
    """Slots ``0 .. this - 1`` the trainer may have pinned: it maps the pool, and was handed one of
    them while it did (NOTE [ Giving slots back ] in loader_service/supervisor/slots.py)."""
    encode_now: int = -1
    """Thousandths of its batches' rows the trainer last said it decodes itself (``Heartbeat.encode``);
    -1: what its hello said."""
    spoiled: int = 0
    """Rows it reported it could not decode (``Spoiled``): at most the rows announced to it."""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    opened_by: Hello | None = None
    """The hello that opened or last resumed the session: the same one again is a repeat."""
    loop: TrainerLoop = field(default_factory=TrainerLoop)
    served: npt.NDArray[np.int64] | None = None
    """Rows announced to it by source, for a feed of several (NOTE [ Source ledger ])."""
    """The trainer loop's waits, compute and pulls from its heartbeats, and what the service saw of
    them (NOTE [ Fleet load ], NOTE [ Sizing workers ])."""

    def note_announced(self, slot: int) -> None:
        """A batch in ``slot`` was announced to the trainer: one that maps the pool may pin every
        slot up to it (NOTE [ Giving slots back ])."""
        if not self.remote:
            self.pinned_through = max(self.pinned_through, slot + 1)

    def presents(self, token: str) -> bool:
        """Is ``token`` this session's? Compared in constant time."""
        return hmac.compare_digest(token.encode(), self.token.encode())

    @property
    def sent(self) -> int:
        """The last lease id announced to this session (0: none yet)."""
        return self.next_lease - 1

    @property
    def client(self) -> str:
        """The trainer's self-description, made safe for a log line or a terminal
        (NOTE [ Chosen names are shown as text ])."""
        return printable(self.hello.client)

    @property
    def encode(self) -> int:
        """Thousandths of each of its batches' rows to leave encoded (NOTE [ Encoded rows ])."""
        return self.hello.encode if self.encode_now < 0 else self.encode_now

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
