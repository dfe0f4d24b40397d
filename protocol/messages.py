"""Messages between trainers, the loader service and its decode workers.

Every message is one ZeroMQ frame holding one msgpack map::

    {"v": PROTOCOL_VERSION, "k": <kind>, <field>: <value>, ...}

Pixels never travel in a message: a ``batch`` names a slot of the feed's shared-memory segment (see
``protocol.layout``), and the trainer maps it. A trainer's session looks like this::

    trainer (DEALER)                         service (ROUTER)
      hello{feed, credits} ---------------->
                           <---------------- welcome{session, feed info, segment}
      start{run, epoch, position} -------->
                           <---------------- batch{run, epoch, seq, lease, slot, count}   (<= credits
                           <---------------- batch ...                                     unreleased)
      release{leases} --------------------->
                           <---------------- end{run, epoch, batches}
      heartbeat{session}  (from a second socket, every heartbeat interval)
      bye ---------------------------------->

    any peer: status? -> status{body}   (no session needed)

Decode workers speak ``w_ready`` / ``task`` / ``done`` / ``stop`` with the service on a private socket.

Decoding never trusts its input: frames above ``MAX_FRAME_BYTES`` are refused before unpacking, msgpack
runs with ``raw=False`` and ``strict_map_key=True``, and every field is checked for type and range.
A frame that fails any check raises ``ProtocolError``; the receiver answers or drops it, never crashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
MAX_RELEASES = 4096
MAX_CREDITS = 1024
MAX_BAD_REPORTS = 256
_MAX_INT = 2**62
_MAX_STR = 512


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _int(d: Mapping[str, Any], key: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    value = d.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _float(d: Mapping[str, Any], key: str, lo: float, hi: float) -> float:
    value = d.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"field {key!r} must be a number in [{lo}, {hi}], got {value!r:.80}")
    return float(value)


def _str(d: Mapping[str, Any], key: str, max_len: int = _MAX_STR) -> str:
    value = d.get(key)
    if type(value) is not str or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be a string of at most {max_len} characters")
    return value


def _leases(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    leases = _list(d, key, MAX_RELEASES)
    if any(type(x) is not int or not 0 <= x < _MAX_INT for x in leases):
        raise ProtocolError(f"field {key!r} must hold non-negative integers")
    return tuple(leases)


def _choice(d: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = d.get(key)
    if value not in choices:
        raise ProtocolError(f"field {key!r} must be one of {', '.join(choices)}")
    return str(value)


def _bool(d: Mapping[str, Any], key: str) -> bool:
    value = d.get(key)
    if type(value) is not bool:
        raise ProtocolError(f"field {key!r} must be a boolean")
    return value


def _bytes(d: Mapping[str, Any], key: str, max_len: int) -> bytes:
    value = d.get(key)
    if type(value) is not bytes or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be bytes of at most {max_len}")
    return value


def _list(d: Mapping[str, Any], key: str, max_len: int) -> list[Any]:
    value = d.get(key)
    if type(value) is not list or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be a list of at most {max_len} items")
    return value


def _map(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key)
    if type(value) is not dict:
        raise ProtocolError(f"field {key!r} must be a map")
    return value


@dataclass(frozen=True)
class Message:
    """Base of every message; ``KIND`` is its tag on the wire."""

    KIND: ClassVar[str] = ""

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Message:
        raise NotImplementedError


# --- trainer -> service -------------------------------------------------------------------------


MODES = ("shard", "broadcast")
REMAINDERS = ("pad", "drop")


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
    client: str
    pid: int
    feed: str = ""
    credits: int = 6
    mode: str = "shard"
    rank: int = 0
    world_size: int = 1
    remainder: str = "pad"
    group: str = ""
    group_size: int = 1
    batch_size: int = 0
    image_size: int = 0
    resume: str = ""
    """A session this trainer had, to take over (it lost touch with a live service) ..."""
    held: tuple[int, ...] = ()
    """... keeping only these of its leases: the batches its loop still holds."""

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Hello:
        hello = cls(
            client=_str(d, "client", 128),
            pid=_int(d, "pid"),
            feed=_str(d, "feed", 64),
            credits=_int(d, "credits", 1, MAX_CREDITS),
            mode=_choice(d, "mode", MODES),
            rank=_int(d, "rank", 0, 65535),
            world_size=_int(d, "world_size", 1, 65536),
            remainder=_choice(d, "remainder", REMAINDERS),
            group=_str(d, "group", 64),
            group_size=_int(d, "group_size", 1, 1024),
            batch_size=_int(d, "batch_size", 0, 65536),
            image_size=_int(d, "image_size", 0, 8192),
            resume=_str(d, "resume", 64) if "resume" in d else "",
            held=_leases(d, "held") if "held" in d else (),
        )
        if hello.rank >= hello.world_size:
            raise ProtocolError(f"rank {hello.rank} must be below world_size {hello.world_size}")
        return hello


@dataclass(frozen=True)
class Start(Message):
    """Deliver ``epoch`` from batch ``position`` on, tagging every batch with ``run``.

    A new start cancels the previous one; batches of older runs that still arrive are released unread.
    """

    KIND: ClassVar[str] = "start"
    run: int
    epoch: int
    position: int = 0

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Start:
        return cls(_int(d, "run", 0, 2**31), _int(d, "epoch", 0, 2**40), _int(d, "position", 0, 2**40))


@dataclass(frozen=True)
class Release(Message):
    """Hand ``leases`` back: their slots may be reused, and each returns one credit."""

    KIND: ClassVar[str] = "release"
    leases: tuple[int, ...]

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Release:
        return cls(_leases(d, "leases"))


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness in either direction; from a trainer's second socket it names the session it keeps alive."""

    KIND: ClassVar[str] = "heartbeat"
    session: str = ""

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Heartbeat:
        return cls(_str(d, "session", 64))


@dataclass(frozen=True)
class Bye(Message):
    """The trainer is leaving: its leases are returned at once."""

    KIND: ClassVar[str] = "bye"

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Bye:
        return cls()


# --- service -> trainer -------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedInfo:
    """What a trainer needs to know about the feed it attached to."""

    name: str
    samples: int
    classes: int
    batch_size: int
    image_size: int
    batches_per_epoch: int
    seed: int
    augment: str
    fingerprint: str
    segment: str
    slots: int

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> FeedInfo:
        return cls(
            name=_str(d, "name", 64),
            samples=_int(d, "samples"),
            classes=_int(d, "classes"),
            batch_size=_int(d, "batch_size", 1, 65536),
            image_size=_int(d, "image_size", 1, 8192),
            batches_per_epoch=_int(d, "batches_per_epoch"),
            seed=_int(d, "seed"),
            augment=_str(d, "augment", 16),
            fingerprint=_str(d, "fingerprint", 128),
            segment=_str(d, "segment", 255),
            slots=_int(d, "slots", 1, 65536),
        )


@dataclass(frozen=True)
class Welcome(Message):
    """Session accepted: ``batches`` and ``samples`` are this trainer's share of one epoch."""

    KIND: ClassVar[str] = "welcome"
    session: str
    feed: FeedInfo
    heartbeat_interval: float
    batches: int
    samples: int

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Welcome:
        return cls(
            _str(d, "session", 64),
            FeedInfo.from_fields(_map(d, "feed")),
            _float(d, "heartbeat_interval", 0.01, 3600),
            _int(d, "batches"),
            _int(d, "samples"),
        )


@dataclass(frozen=True)
class StatusRequest(Message):
    """Ask for a snapshot of the service; needs no session (``loader-service status``, tests)."""

    KIND: ClassVar[str] = "status?"

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> StatusRequest:
        return cls()


@dataclass(frozen=True)
class StatusReply(Message):
    """``body``: a JSON-shaped map (feeds, sessions, workers, counters); informational, not a contract."""

    KIND: ClassVar[str] = "status"
    body: Mapping[str, Any]

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> StatusReply:
        return cls(_map(d, "body"))


@dataclass(frozen=True)
class BatchReady(Message):
    """Batch ``seq`` of ``epoch`` is in ``slot``: rows ``[0, count)`` are valid. Release it by ``lease``."""

    KIND: ClassVar[str] = "batch"
    run: int
    epoch: int
    seq: int
    lease: int
    slot: int
    count: int

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> BatchReady:
        return cls(
            _int(d, "run", 0, 2**31),
            _int(d, "epoch"),
            _int(d, "seq"),
            _int(d, "lease"),
            _int(d, "slot", 0, 65535),
            _int(d, "count", 0, 65536),
        )


@dataclass(frozen=True)
class EpochEnd(Message):
    KIND: ClassVar[str] = "end"
    run: int
    epoch: int
    batches: int

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> EpochEnd:
        return cls(_int(d, "run", 0, 2**31), _int(d, "epoch"), _int(d, "batches"))


@dataclass(frozen=True)
class ErrorReply(Message):
    """A refused request. ``fatal`` means the session is over and the trainer should raise."""

    KIND: ClassVar[str] = "error"
    code: str
    message: str
    fatal: bool = False

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> ErrorReply:
        return cls(_str(d, "code", 64), _str(d, "message", 2048), _bool(d, "fatal"))


# --- service <-> decode worker ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady(Message):
    KIND: ClassVar[str] = "w_ready"
    worker: int
    pid: int

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> WorkerReady:
        return cls(_int(d, "worker", 0, 4096), _int(d, "pid"))


@dataclass(frozen=True)
class Task(Message):
    """Decode the samples ``indices`` (little-endian int64) of ``epoch`` into ``slot`` of ``feed``."""

    KIND: ClassVar[str] = "task"
    task: int
    feed: int
    slot: int
    epoch: int
    indices: bytes

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> Task:
        indices = _bytes(d, "indices", 8 * 65536)
        if len(indices) % 8:
            raise ProtocolError("field 'indices' must hold whole int64 values")
        return cls(
            _int(d, "task"), _int(d, "feed", 0, 255), _int(d, "slot", 0, 65535), _int(d, "epoch"), indices
        )


@dataclass(frozen=True)
class TaskDone(Message):
    """Rows ``[0, count)`` of the task's slot are written; ``bad`` lists (index, reason) of skipped files."""

    KIND: ClassVar[str] = "done"
    task: int
    worker: int
    count: int
    bad: tuple[tuple[int, str], ...] = field(default=())

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> TaskDone:
        bad = []
        for item in _list(d, "bad", MAX_BAD_REPORTS):
            if type(item) is not list or len(item) != 2:
                raise ProtocolError("field 'bad' must hold [index, reason] pairs")
            bad.append((_int({"i": item[0]}, "i"), _str({"r": item[1]}, "r")))
        return cls(_int(d, "task"), _int(d, "worker", 0, 4096), _int(d, "count", 0, 65536), tuple(bad))


@dataclass(frozen=True)
class StopWorker(Message):
    KIND: ClassVar[str] = "stop"

    @classmethod
    def from_fields(cls, d: Mapping[str, Any]) -> StopWorker:
        return cls()


_KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Start,
        Release,
        Heartbeat,
        Bye,
        Welcome,
        StatusRequest,
        StatusReply,
        BatchReady,
        EpochEnd,
        ErrorReply,
        WorkerReady,
        Task,
        TaskDone,
        StopWorker,
    )
}

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """Pack ``message`` into one frame."""
    body = asdict(message)
    if isinstance(message, Release):
        body["leases"] = list(message.leases)
    if isinstance(message, Hello):
        body["held"] = list(message.held)
    if isinstance(message, TaskDone):
        body["bad"] = [list(b) for b in message.bad]
    frame: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "k": message.KIND, **body}, use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{message.KIND} message of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes | memoryview, expect: tuple[type[M], ...]) -> M:
    """Unpack one frame, accepting only the message classes in ``expect``."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        d = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"not a msgpack frame: {type(exc).__name__}") from None
    if type(d) is not dict:
        raise ProtocolError("a message must be a msgpack map")
    if d.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {d.get('v')!r:.20} is not {PROTOCOL_VERSION}")
    kind = d.get("k")
    cls = _KINDS.get(kind) if type(kind) is str else None
    if cls is None or not issubclass(cls, expect):
        raise ProtocolError(f"unexpected message kind {kind!r:.40}")
    try:
        return cls.from_fields(d)  # type: ignore[return-value]
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as exc:  # never let a field check crash a receiver
        raise ProtocolError(f"malformed {kind} message: {type(exc).__name__}") from None
