"""Every message as one msgpack frame, and back, checked field by field against its declaration
(``protocol.schema``), within ``MAX_FRAME_BYTES``."""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgpack

from protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_RELEASES,
    PROTOCOL_VERSION,
    Ack,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    Heartbeat,
    Hello,
    Message,
    Release,
    Spoiled,
    Start,
    StatusReply,
    StatusRequest,
    Want,
    Welcome,
)
from protocol.schema import (
    ProtocolError,
    Record,
)
from protocol.workers import StopWorker, Task, TaskDone, WorkerReady

MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    Hello,
    Start,
    Want,
    Release,
    Heartbeat,
    Spoiled,
    Bye,
    Ack,
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
# Compiled once at import: a declaration the decoder cannot use fails here, not on the first frame.
_RECORDS: Final[dict[str, Record]] = {cls.KIND: Record(cls, envelope=("v", "k")) for cls in MESSAGE_TYPES}

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """Pack ``message`` into one frame."""
    body = _RECORDS[message.KIND].encode_into({"v": PROTOCOL_VERSION, "k": message.KIND}, message)
    frame: bytes = msgpack.packb(body, use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{message.KIND} message of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes | memoryview, expect: tuple[type[M], ...]) -> M:
    """Unpack one frame, accepting only the message classes in ``expect``."""
    d = _unpack(frame)
    # The envelope is checked inline: this runs for every frame, and a call costs as much as a test.
    version = d.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r:.20} is not {PROTOCOL_VERSION}")
    kind = d.get("k")
    record = _RECORDS.get(kind) if type(kind) is str else None
    if record is None or not issubclass(record.cls, expect):
        raise ProtocolError(f"unexpected message kind {kind!r:.40}")
    try:
        message: M = record.build(d)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as exc:  # never let a field check crash a receiver
        raise ProtocolError(f"malformed {kind} message: {type(exc).__name__}") from None
    return message


MAX_MAP_LEN: Final = 256
"""Keys in any one map of a frame: a message declares at most about twenty fields, and a status body
has no wider map. msgpack refuses a longer map from its header, before building it (a 50 KB frame
of 6000 keys cost about 1.7 ms to build and then refuse by name)."""


def _unpack(frame: bytes | memoryview) -> dict[str, Any]:
    # The size test comes first, so a hostile peer cannot make msgpack allocate for a huge frame.
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        d = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_map_len=MAX_MAP_LEN,
            max_array_len=MAX_RELEASES,
            max_ext_len=0,
        )
    except ValueError as exc:  # a length over a limit says which, in a few words
        raise ProtocolError(f"not a msgpack frame: {type(exc).__name__}: {str(exc)[:80]}") from None
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"not a msgpack frame: {type(exc).__name__}") from None
    if type(d) is not dict:
        raise ProtocolError("a message must be a msgpack map")
    return d
