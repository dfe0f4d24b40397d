"""The wire format: round trips, and refusal of every kind of malformed frame."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import layout
from protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BatchReady,
    Bye,
    EpochEnd,
    ErrorReply,
    FeedInfo,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Release,
    Start,
    StopWorker,
    Task,
    TaskDone,
    Welcome,
    WorkerReady,
    decode,
    encode,
)

FEED = FeedInfo("train", 100, 10, 64, 224, 2, 0, "train", "ab" * 16, "dataferry-1-train-00", 12)
EXAMPLES: list[Message] = [
    Hello("host:1", 1, "train", 6),
    Start(3, 2, 1),
    Release((1, 2, 3)),
    Heartbeat("abc"),
    Bye(),
    Welcome("s1", FEED, 1.0, 2, 100),
    BatchReady(1, 2, 3, 4, 5, 64),
    EpochEnd(1, 2, 3),
    ErrorReply("bad", "why", True),
    WorkerReady(1, 99),
    Task(1, 0, 2, 3, b"\x00" * 16),
    TaskDone(1, 2, 3, ((4, "empty file"),)),
    StopWorker(),
]
ALL = tuple({type(m) for m in EXAMPLES})


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg), ALL) == msg


def frame(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "not a msgpack frame"),
        (b"\xc1garbage", "not a msgpack frame"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"v": 99, "k": "bye"}), "protocol version"),
        (frame(k="nope"), "unexpected message kind"),
        (frame(k="start", run=1, epoch=True, position=0), "'epoch' must be an integer"),
        (frame(k="start", run=-1, epoch=0, position=0), "'run' must be an integer"),
        (frame(k="start", run=1, epoch=0), "'position'"),
        (frame(k="hello", client="x", pid=1, feed="f", credits=10**6), "'credits'"),
        (frame(k="hello", client="x" * 1000, pid=1, feed="f", credits=2), "'client'"),
        (frame(k="release", leases=list(range(5000))), "'leases'"),
        (frame(k="release", leases=["a"]), "'leases'"),
        (frame(k="release", leases=[-1]), "'leases'"),
        (frame(k="task", task=1, slot=0, epoch=0, indices=b"abc"), "whole int64"),
        (frame(k="welcome", session="s", feed=5, heartbeat_interval=1.0), "'feed' must be a map"),
        (frame(k="welcome", session="s", feed={}, heartbeat_interval=float("nan")), "'name'"),
        (b"\x81" + b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_frames_are_refused(raw: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(raw, ALL)


def test_kind_outside_expected_set_is_refused() -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode(encode(Task(1, 0, 2, 3, b"")), (Hello, Start))


def test_integer_keys_are_refused() -> None:
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({1: 2}), ALL)


def test_encode_refuses_oversized_messages() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(ErrorReply("x", "y" * (MAX_FRAME_BYTES + 10)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_error(raw: bytes) -> None:
    try:
        decode(raw, ALL)
    except ProtocolError:
        pass


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from([m.KIND for m in EXAMPLES]),
    fields=st.dictionaries(st.text(max_size=12), values, max_size=6),
)
def test_wrong_shaped_maps_only_ever_raise_protocol_error(kind: str, fields: dict[str, Any]) -> None:
    try:
        decode(frame(k=kind, **{k: v for k, v in fields.items() if k not in ("v", "k")}), ALL)
    except ProtocolError:
        pass


@pytest.mark.parametrize("name", ["dataferry-1-train-ab12", "dataferry-x"])
def test_segment_names_of_ours_are_accepted(name: str) -> None:
    assert layout.validate_segment_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x",
        "dataferry-",
        "dataferry-../../etc/passwd",
        "/dev/shm/dataferry-1",
        "dataferry-a/b",
        "dataferry-" + "a" * 300,
    ],
)
def test_segment_names_that_could_point_elsewhere_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        layout.validate_segment_name(name)


def test_slot_layout_is_aligned_and_disjoint() -> None:
    lay = layout.SlotLayout(capacity=64, size=224)
    assert lay.image_bytes == 3 * 224 * 224
    assert lay.labels_offset >= 64 * lay.image_bytes and lay.labels_offset % 64 == 0
    assert lay.indices_offset == lay.labels_offset + 8 * 64
    assert lay.stride % layout.PAGE == 0 and lay.stride >= lay.indices_offset + 8 * 64
    assert lay.slot_offset(3, 4) == 3 * lay.stride
    with pytest.raises(ValueError):
        lay.slot_offset(4, 4)


@pytest.mark.parametrize("kind", [[1], {"a": 1}, 3, None, b"hello"])
def test_kinds_of_the_wrong_type_are_refused_not_crashed_on(kind: object) -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "k": kind}, use_bin_type=True), ALL)
