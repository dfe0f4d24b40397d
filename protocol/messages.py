"""Messages between trainers, the loader service and its decode workers (theirs are declared in
``protocol.workers``; ``protocol.codec`` turns every message into one frame and back).

Every message is one ZeroMQ frame holding one msgpack map, keys in this order::

    {"v": PROTOCOL_VERSION, "k": <kind>, <field>: <value>, ...}     (fields in declaration order)

A ``batch`` names a slot of the feed's shared-memory segment (see ``protocol.layout``). A trainer on
the service's host maps the segment and reads the slot in place; a trainer that cannot (another
host: its ``start`` says ``transport=tcp``) gets raw frames after the ``batch`` frame, one per field
of the feed's layout in its order and then one of the indices (``SlotLayout.parts``), rows
``[0, count)`` only, each a copy of the slot's bytes (NOTE [ Remote sends ]); where the feed offers
encoded rows (``FeedInfo.encoded``), then the table's rows ``[0, count)`` and the byte area up to the
last byte they name (NOTE [ Encoded rows ] in protocol/encoded.py). Either way the
trainer releases the batch by its lease. A trainer's session (the fields each message may carry;
``tests/unit/test_protocol.py`` keeps every name below a field of its kind)::

    trainer (DEALER)                         service (ROUTER)
      hello{feed, credits, mode, rank, world_size, batch_size, image_size[, resume, held, have,
            encode]} ->
                           <---------------- welcome{session, token, feed, credits, heartbeat_interval}
      start{run, epoch, position, transport, picked, want, token, offset} ->
      want{run, seqs, token} -------------->   (a picked start only: these batches too)
                           <---------------- batch{run, epoch, seq, lease, slot, count}   (<= credits
                           <---------------- batch ... [+ each field | indices]          unreleased)
      release{leases, token} -------------->
                           <---------------- heartbeat{sent, run}  (every heartbeat interval)
      ack{have, missing, held, token} ----->
                           <---------------- batch ... (again: each lease named in ``missing``)
                           <---------------- end{run, epoch, batches}
      heartbeat{token, waited, computed, pulls, encode}  (from a second socket, every heartbeat
                                                  interval; NOTE [ Early heartbeat ])
      spoiled{samples, token} -------------->   (encoded rows it could not decode: NOTE [ Encoded rows ])
      bye{token} --------------------------->

Leases are numbered per session, 1, 2, 3, ... in the order they are announced, so a trainer knows
exactly which announcements it has not received (NOTE [ Acknowledged delivery ] in
``gpu_worker/arrivals.py``): ``ack`` says how far it has every one (``have``), which later ones it
found missing (the service announces those again, same lease, same bytes), and which of the first
``have`` its loop still holds (the service frees the others: their releases were lost).

    any peer: status? -> status{body}   (no session needed; shows no token)

Decode workers talk to the service on a private socket::

    decode worker (DEALER)                   service (ROUTER)
      w_ready{worker, pid} ---------------->
                           <---------------- task{task, feed, slot, epoch, indices, row}
      done{task, worker, count, bad, retry} ->
                           <---------------- stop

Each message below is a frozen dataclass whose fields declare their wire rule beside them (type and
bounds, see ``protocol.schema``); one generic decoder applies the rules of whatever kind arrived.
Decoding never trusts its input: frames above ``MAX_FRAME_BYTES`` are refused before unpacking, msgpack
runs with ``raw=False`` and ``strict_map_key=True``, every field is checked for type and range, and a
missing or unknown key is refused. A frame that fails any check raises ``ProtocolError`` naming the
field; the receiver answers or drops it, never crashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Final

from protocol.encoded import MAX_SHARE
from protocol.layout import DTYPES, MAX_DIMS, MAX_ENCODED, MAX_FIELDS
from protocol.schema import (
    OMITTABLE,
    AnyMap,
    Bool,
    Float,
    Int,
    Invalid,
    Items,
    ListOf,
    OneOf,
    Pair,
    ProtocolError,
    Str,
)
from protocol.weights import MAX_EPOCH_SAMPLES

__all__ = [
    "MAX_BAD_REPORTS",
    "MAX_CREDITS",
    "MAX_FRAME_BYTES",
    "MAX_RELEASES",
    "MODES",
    "PROTOCOL_VERSION",
    "REMAINDERS",
    "TRANSPORTS",
    "Ack",
    "BatchReady",
    "Bye",
    "EpochEnd",
    "ErrorReply",
    "FeedInfo",
    "Heartbeat",
    "Hello",
    "Message",
    "ProtocolError",
    "Release",
    "Spoiled",
    "Start",
    "StatusReply",
    "StatusRequest",
    "Want",
    "Welcome",
]

PROTOCOL_VERSION: Final = 12
MAX_FRAME_BYTES: Final = 64 * 1024
_FIELDS: Final = ListOf(Items((Str(64), OneOf(DTYPES), ListOf(Int(1, 1 << 24), MAX_DIMS))), MAX_FIELDS)
MAX_RELEASES: Final = 4096
MAX_CREDITS: Final = 1024
MAX_SOURCES: Final = 256
MAX_WEIGHT_CHANGES: Final = 64
"""Weight changes a job's start may carry (``Start.changes``): each epoch that holds one is chosen
anew when the job plans (NOTE [ Weightings ] in loader_service/dataset/mixture.py)."""
"""Named sources of one feed (``--source``)."""
MAX_BAD_REPORTS: Final = 256
_LEASE = Int(0, 2**62 - 1)
MAX_EPOCH: Final = 2**40
"""The largest epoch a ``start`` may name; a checkpoint or ``set_epoch`` beyond it is refused where
it is given, not 30 s later when the service refuses the start."""
_SEQ = Int(0, 2**40)
_MILLIS = Int(0, 2**53)


@dataclass(frozen=True)
class Message:
    """Base of every message; ``KIND`` is its tag on the wire."""

    KIND: ClassVar[str] = ""


# --- trainer -> service -------------------------------------------------------------------------


MODES: Final = ("shard", "broadcast")
REMAINDERS: Final = ("pad", "drop")
TRANSPORTS: Final = ("shm", "tcp")
_TOKEN = Str(64)
"""A session's secret (``Welcome.token``): every message of the session carries it, so knowing a
session's public label, or sharing its connection, is never enough to act for it."""


@dataclass(frozen=True)
class Hello(Message):
    """Open a session on ``feed`` ("" picks the service's first feed), allowing ``credits`` batches
    to be delivered and not yet released at any time.

    ``mode="shard"``: this trainer is ``rank`` of ``world_size`` and gets its disjoint share of every
    epoch (``remainder`` says whether the last uneven samples are padded or dropped).
    ``mode="broadcast"``: every member of ``group`` gets every batch, decoded once; the group's first
    epoch starts when ``group_size`` members have started it.
    ``batch_size`` / ``image_size``, when not 0, are what the trainer expects; a feed serving another
    geometry refuses the session instead of delivering the wrong shape.
    """

    KIND: ClassVar[str] = "hello"
    client: Annotated[str, Str(128)]
    pid: Annotated[int, Int()]
    feed: Annotated[str, Str(64)] = ""
    credits: Annotated[int, Int(1, MAX_CREDITS)] = 6
    mode: Annotated[str, OneOf(MODES)] = "shard"
    rank: Annotated[int, Int(0, 65535)] = 0
    world_size: Annotated[int, Int(1, 65536)] = 1
    remainder: Annotated[str, OneOf(REMAINDERS)] = "pad"
    group: Annotated[str, Str(64)] = ""
    group_size: Annotated[int, Int(1, 1024)] = 1
    batch_size: Annotated[int, Int(0, 65536)] = 0
    image_size: Annotated[int, Int(0, 8192)] = 0
    resume: Annotated[str, _TOKEN, OMITTABLE] = ""
    """The token of a session this trainer had, to take over (it lost touch with a live service) ..."""
    held: Annotated[tuple[int, ...], ListOf(_LEASE, MAX_RELEASES), OMITTABLE] = ()
    """... keeping only these of its first ``have`` leases: the batches its loop still holds ..."""
    have: Annotated[int, _LEASE, OMITTABLE] = 0
    """... and announcing again every lease after ``have`` that it still has (NOTE [ Acknowledged
    delivery ]): they may have been lost with the old connection."""
    group_secret: Annotated[str, Str(64), OMITTABLE] = field(default="", repr=False)
    """Broadcast: the group is ``group`` among the trainers that know this secret; one that does not
    lands in another group of the same name and can neither join nor hold up this one."""
    weights: Annotated[
        tuple[tuple[str, float], ...], ListOf(Items((Str(64), Float(0.0, 1e300))), MAX_SOURCES), OMITTABLE
    ] = ()
    """A mixture: each named source's weight (NOTE [ Mixture order ] in loader_service/dataset/mixture.py);
    empty: every source once an epoch, shuffled together."""
    epoch_samples: Annotated[int, Int(0, MAX_EPOCH_SAMPLES), OMITTABLE] = 0
    """With ``weights``: samples in one epoch of the mixture; 0: the feed's size."""
    encode: Annotated[int, Int(0, MAX_SHARE), OMITTABLE] = 0
    """Thousandths of each batch's rows this trainer decodes itself, to begin with (NOTE [ Encoded
    rows ]); ``Heartbeat.encode`` moves it. 0: every row decoded by the service."""

    def cross_check(self) -> None:
        """Called by the decoder once every field has passed its own rule."""
        if self.rank >= self.world_size:
            raise Invalid.field("rank", f"must be below 'world_size' ({self.world_size}), got {self.rank}")


@dataclass(frozen=True)
class Start(Message):
    """Deliver ``epoch`` from batch ``position`` on, tagging every batch with ``run``.

    A new start cancels the previous one; batches of older runs that still arrive are released unread.
    """

    KIND: ClassVar[str] = "start"
    run: Annotated[int, Int(0, 2**31)]
    epoch: Annotated[int, Int(0, MAX_EPOCH)]
    position: Annotated[int, Int(0, 2**40)] = 0
    transport: Annotated[str, OneOf(TRANSPORTS)] = "shm"
    """``tcp``: this trainer cannot map the segment; send each batch's bytes after its ``batch``."""
    picked: Annotated[bool, Bool()] = False
    """Shard mode: decode only the batches this trainer names (``want`` here and in ``want``
    messages), the lowest first, and send no ``end``: a fleet's trainer hands each batch of its
    share to one of several services (NOTE [ A fleet ] in ``gpu_worker/fleet_pass.py``)."""
    want: Annotated[tuple[int, ...], ListOf(_SEQ, MAX_CREDITS)] = ()
    token: Annotated[str, _TOKEN] = ""
    offset: Annotated[int, Int(0, 2**40), OMITTABLE] = 0
    """Shard mode: positions of the epoch's order a job took before this one (an elastic resume);
    the rest is shared out by this trainer's rank and world size (NOTE [ Elastic epochs ] in
    protocol/shares.py). ``position`` counts batches of that share."""
    changes: Annotated[
        tuple[tuple[int, tuple[float, ...]], ...],
        ListOf(Items((Int(0, 2**62), ListOf(Float(0.0, 1e300), MAX_SOURCES))), MAX_WEIGHT_CHANGES),
        OMITTABLE,
    ] = ()
    """A weighted job: its weights from global positions of its run on (``epoch * epoch_samples``
    plus the position in the epoch), each source's in the order of ``FeedInfo.sources``, after the
    hello's weights (NOTE [ Weight changes ] in gpu_worker/weighting.py)."""


@dataclass(frozen=True)
class Want(Message):
    """A picked run (``Start.picked``): decode and announce batches ``seqs`` of it too. The service
    ignores a seq past the epoch, or one it was asked for whose batch it has not yet announced or
    still has leased to the trainer; it keeps at most ``credits`` asked-for batches queued. So a
    trainer names again what has not arrived, and asks again for a batch it let go unread."""

    KIND: ClassVar[str] = "want"
    run: Annotated[int, Int(0, 2**31)]
    seqs: Annotated[tuple[int, ...], ListOf(_SEQ, MAX_CREDITS)]
    token: Annotated[str, _TOKEN] = ""


@dataclass(frozen=True)
class Release(Message):
    """Hand ``leases`` back: their slots may be reused, and each returns one credit."""

    KIND: ClassVar[str] = "release"
    leases: Annotated[tuple[int, ...], ListOf(_LEASE, MAX_RELEASES)]
    token: Annotated[str, _TOKEN] = ""


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness in either direction; from a trainer's second socket it carries the token of the session
    it keeps alive. From the service it also says the last lease announced to the session (``sent``)
    and the run it serves (``run``): on one connection messages arrive in order, so a trainer that
    gets this heartbeat without lease ``sent`` knows that announcement was lost, and one whose run
    is newer knows its start was (NOTE [ Acknowledged delivery ]). From a trainer it also carries
    how long its loop has waited in ``next()`` and computed between pulls, in milliseconds since
    the loader began, and how many batches it has pulled (NOTE [ Exposed wait ] in
    gpu_worker/loop_clock.py)."""

    KIND: ClassVar[str] = "heartbeat"
    token: Annotated[str, _TOKEN] = ""
    sent: Annotated[int, _LEASE, OMITTABLE] = 0
    run: Annotated[int, Int(-1, 2**31), OMITTABLE] = -1
    waited: Annotated[int, _MILLIS, OMITTABLE] = 0
    computed: Annotated[int, _MILLIS, OMITTABLE] = 0
    pulls: Annotated[int, _MILLIS, OMITTABLE] = 0
    encode: Annotated[int, Int(-1, MAX_SHARE), OMITTABLE] = -1
    """From a trainer: the thousandths of its batches' rows it now decodes itself (``Hello.encode``);
    -1: unchanged. From the service: unused."""


@dataclass(frozen=True)
class Ack(Message):
    """What the trainer has received (NOTE [ Acknowledged delivery ]): every lease up to ``have``;
    ``missing`` leases after it never arrived (announce them again); of the leases up to ``have`` it
    still holds only ``held`` (every other one was released, even if that release was lost)."""

    KIND: ClassVar[str] = "ack"
    have: Annotated[int, _LEASE]
    missing: Annotated[tuple[int, ...], ListOf(_LEASE, MAX_RELEASES)] = ()
    held: Annotated[tuple[int, ...], ListOf(_LEASE, MAX_RELEASES)] = ()
    token: Annotated[str, _TOKEN] = ""


@dataclass(frozen=True)
class Spoiled(Message):
    """Samples of encoded rows this trainer could not decode, each with why (NOTE [ Encoded rows ]):
    left out of their batches; the service logs and counts them as bad files."""

    KIND: ClassVar[str] = "spoiled"
    samples: Annotated[tuple[tuple[int, str], ...], ListOf(Pair(Int(), Str()), MAX_BAD_REPORTS)]
    token: Annotated[str, _TOKEN] = ""


@dataclass(frozen=True)
class Bye(Message):
    """The trainer is leaving: its leases are returned at once."""

    KIND: ClassVar[str] = "bye"
    token: Annotated[str, _TOKEN] = ""


# --- service -> trainer -------------------------------------------------------------------------


MAX_DECODING = 512
MAX_WHERE = 4096
"""Characters of a path or URL a feed names (``FeedInfo.data``, ``pipeline``): Linux's PATH_MAX."""


@dataclass(frozen=True)
class FeedInfo:
    """What a trainer needs to know about the feed it attached to."""

    name: Annotated[str, Str(64)]
    samples: Annotated[int, Int()]
    classes: Annotated[int, Int()]
    batch_size: Annotated[int, Int(1, 65536)]
    image_size: Annotated[int, Int(0, 8192)]
    """The built-in transforms' output size; 0 for a user pipeline."""
    batches_per_epoch: Annotated[int, Int()]
    seed: Annotated[int, Int()]
    augment: Annotated[str, Str(16)]
    fingerprint: Annotated[str, Str(128)]
    segment: Annotated[str, Str(255)]
    slots: Annotated[int, Int(1, 65536)]
    fields: Annotated[tuple[tuple[str, str, tuple[int, ...]], ...], _FIELDS]
    """Each batch field as ``[name, dtype, shape]``, in slot order (``protocol.layout``)."""
    check: Annotated[str, Str(64)] = ""
    """Hex of the bytes the service wrote after the pool (``protocol.layout``): a trainer that finds
    them in the segment it opened knows it mapped this service's pool, not a namesake."""
    decoding: Annotated[str, Str(MAX_DECODING), OMITTABLE] = ""
    """``KEY=VALUE`` words, space-separated: what else decides which samples a batch holds and their
    pixels (``supervisor.feeds.decoding_of``). Services of one fleet must say the same."""
    sources: Annotated[tuple[str, ...], ListOf(Str(64), MAX_SOURCES), OMITTABLE] = ()
    """The feed's named sources in numbering order (``--source``); empty for a feed of ``--data``."""
    source_sizes: Annotated[tuple[int, ...], ListOf(Int(1), MAX_SOURCES), OMITTABLE] = ()
    """Samples of each source: feed sample ``i`` is sample ``i - sum(sizes before)`` of its source
    (NOTE [ Sources of a feed ] in loader_service/dataset/sources.py)."""
    data: Annotated[str, Str(MAX_WHERE), OMITTABLE] = ""
    """Where the feed's data is, as its ``--data`` names it: a path made absolute on the service's
    host, or an object store's URL as given; empty for a feed of ``--source``s. What a trainer asked
    of ``ServiceLoader.local`` is checked against it (``fingerprint`` is what proves the data)."""
    pipeline: Annotated[str, Str(MAX_WHERE), OMITTABLE] = ""
    """The feed's ``--pipeline`` (a ``FILE.py`` made absolute), empty for the built-in transforms."""
    encoded: Annotated[int, Int(0, MAX_ENCODED), OMITTABLE] = 0
    """Bytes of room a row for encoded rows in every slot (NOTE [ Encoded rows ] in
    protocol/encoded.py); 0: the feed sends none, whatever a trainer asks."""


@dataclass(frozen=True)
class Welcome(Message):
    """Session accepted: ``batches`` and ``samples`` are this trainer's share of one epoch."""

    KIND: ClassVar[str] = "welcome"
    session: Annotated[str, Str(64)]
    """A public label for logs; never a credential."""
    feed: FeedInfo  # a nested map, checked by FeedInfo's own field rules
    heartbeat_interval: Annotated[float, Float(0.01, 3600)]
    batches: Annotated[int, Int()]
    samples: Annotated[int, Int()]
    token: Annotated[str, _TOKEN] = ""
    """The session's secret: every later message of the session, and a resume, must carry it."""
    credits: Annotated[int, Int(1, MAX_CREDITS)] = MAX_CREDITS
    """Credits granted: those asked, at most the session's share of the feed's pool (NOTE
    [ Credits per session ] in loader_service/supervisor/trainers/sessions.py)."""


@dataclass(frozen=True)
class StatusRequest(Message):
    """Ask for a snapshot of the service; needs no session (``loader-service status``, tests)."""

    KIND: ClassVar[str] = "status?"


@dataclass(frozen=True)
class StatusReply(Message):
    """``body``: a JSON-shaped map (feeds, sessions, workers, counters); informational, not a contract."""

    KIND: ClassVar[str] = "status"
    body: Annotated[Mapping[str, Any], AnyMap()]


@dataclass(frozen=True)
class BatchReady(Message):
    """Batch ``seq`` of ``epoch`` is in ``slot``: rows ``[0, count)`` are valid. Release it by ``lease``."""

    KIND: ClassVar[str] = "batch"
    run: Annotated[int, Int(0, 2**31)]
    epoch: Annotated[int, Int()]
    seq: Annotated[int, Int()]
    lease: Annotated[int, Int()]
    slot: Annotated[int, Int(0, 65535)]
    count: Annotated[int, Int(0, 65536)]


@dataclass(frozen=True)
class EpochEnd(Message):
    KIND: ClassVar[str] = "end"
    run: Annotated[int, Int(0, 2**31)]
    epoch: Annotated[int, Int()]
    batches: Annotated[int, Int()]


@dataclass(frozen=True)
class ErrorReply(Message):
    """A refused request. ``fatal`` means the session is over and the trainer should raise."""

    KIND: ClassVar[str] = "error"
    code: Annotated[str, Str(64)]
    message: Annotated[str, Str(2048)]
    fatal: Annotated[bool, Bool()] = False
