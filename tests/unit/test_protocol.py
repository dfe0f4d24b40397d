"""The wire format: round trips, and refusal of every kind of malformed frame."""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import layout, messages, workers
from protocol.codec import MESSAGE_TYPES, decode, encode
from protocol.layout import SlotLayout, image_fields
from protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
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
    Spoiled,
    Start,
    Want,
    Welcome,
)
from protocol.schema import (
    OMITTABLE,
    AnyMap,
    Bool,
    Float,
    Int,
    Items,
    ListOf,
    OneOf,
    PackedInt64,
    Pair,
    Record,
    Rule,
    Str,
)
from protocol.workers import StopWorker, Task, TaskDone, WorkerReady

FEED = FeedInfo(
    "train",
    100,
    10,
    64,
    224,
    2,
    0,
    "train",
    "ab" * 16,
    "dataferry-1-train-00",
    12,
    layout.SlotLayout.images(64, 224).wire(),
)
EXAMPLES: list[Message] = [
    Hello("host:1", 1, "train", 6),
    Start(3, 2, 1),
    Start(3, 2, 0, picked=True, want=(0, 5, 9)),
    Want(4, (10, 11)),
    Release((1, 2, 3)),
    Heartbeat("abc"),
    Heartbeat(sent=3, run=1),
    Ack(4, (6, 7), (1, 2)),
    Bye(),
    Spoiled(((7, "decoder error: bad Huffman table"),)),
    Hello("host:1", 1, encode=500),
    Heartbeat("abc", encode=1000),
    Welcome("s1", FEED, 1.0, 2, 100),
    BatchReady(1, 2, 3, 4, 5, 64),
    EpochEnd(1, 2, 3),
    ErrorReply("bad", "why", True),
    WorkerReady(1, 99),
    Task(1, 0, 2, 3, b"\x00" * 16),
    Task(1, 0, 2, 3, b"\x00" * 16, 8, encode=250),
    TaskDone(1, 2, 3, ((4, "empty file"),)),
    TaskDone(1, 2, 3, encoded=2),
    TaskDone(1, 2, 0, (), retry="s3://bucket/a.tar: connection refused"),
    StopWorker(),
]
ALL = tuple({type(m) for m in EXAMPLES})


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg), ALL) == msg


def frame(**fields: Any) -> bytes:
    packed: bytes = msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)
    return packed


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
        (frame(k="release", leases=list(range(5000))), "exceeds max_array_len"),
        (frame(k="release", leases=["a"]), "'leases'"),
        (frame(k="release", leases=[-1]), "'leases'"),
        (frame(k="task", task=1, feed=0, slot=0, epoch=0, indices=b"abc"), "whole int64"),
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


def test_built_in_layout_is_images_then_labels_then_indices() -> None:
    lay = layout.SlotLayout.images(64, 224)
    assert lay.names == ("image", "label")
    assert lay.offsets[0] == 0 and lay.field("image").row_bytes == 3 * 224 * 224
    assert lay.offsets[1] >= 64 * 3 * 224 * 224 and lay.offsets[1] % 64 == 0
    assert lay.indices_offset == lay.offsets[1] + 8 * 64
    assert lay.stride % layout.PAGE == 0 and lay.stride >= lay.indices_offset + 8 * 64
    assert lay.slot_offset(3, 4) == 3 * lay.stride
    with pytest.raises(ValueError):
        lay.slot_offset(4, 4)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 300),
    fields=st.lists(
        st.tuples(st.sampled_from(layout.DTYPES), st.lists(st.integers(1, 9), max_size=3)),
        min_size=1,
        max_size=6,
    ),
)
def test_fields_never_overlap_and_start_aligned(capacity: int, fields: list[tuple[str, list[int]]]) -> None:
    specs = tuple(layout.FieldSpec(f"f{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(fields))
    lay = layout.SlotLayout(capacity, specs)
    spans = [(off, off + size) for off, size in lay.parts(capacity)]
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= lay.stride and lay.stride % layout.PAGE == 0
    assert layout.SlotLayout.from_wire(capacity, lay.wire()) == lay


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "message"),
    [
        ("1st", "uint8", (3,), "field name"),
        ("a-b", "uint8", (3,), "field name"),
        ("x" * 65, "uint8", (3,), "field name"),
        ("image", "complex64", (3,), "dtype"),
        ("image", "object", (3,), "dtype"),
        ("image", "uint8", (0, 3), "shape"),
        ("image", "uint8", (1,) * 9, "shape"),
        ("image", "uint8", (True,), "shape"),
    ],
)
def test_bad_fields_are_refused_by_name(name: str, dtype: str, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout.FieldSpec(name, dtype, shape)


def test_layouts_that_cannot_be_are_refused() -> None:
    image = layout.FieldSpec("image", "uint8", (3, 8, 8))
    with pytest.raises(ValueError, match="repeat"):
        layout.SlotLayout(4, (image, image))
    with pytest.raises(ValueError, match="fields"):
        layout.SlotLayout(4, ())
    with pytest.raises(ValueError, match="limit"):
        layout.SlotLayout(65536, (layout.FieldSpec("huge", "float64", (1 << 24, 64)),))


def test_feed_info_fields_from_the_wire_are_checked() -> None:
    body = msgpack.unpackb(encode(Welcome("t1", FEED, 1.0, 2, 128)), raw=False)
    body["feed"]["fields"] = [["image", "complex64", [3]]]
    with pytest.raises(ProtocolError, match="fields"):
        decode(msgpack.packb(body, use_bin_type=True), ALL)
    body["feed"]["fields"] = [["image", "uint8", [3, -1]]]
    with pytest.raises(ProtocolError, match="fields"):
        decode(msgpack.packb(body, use_bin_type=True), ALL)


@pytest.mark.parametrize("kind", [[1], {"a": 1}, 3, None, b"hello"])
def test_kinds_of_the_wrong_type_are_refused_not_crashed_on(kind: object) -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "k": kind}, use_bin_type=True), ALL)


# --- the declarations: golden frames, and properties derived from every message's field rules -----

# Frames of protocol version 12 (version 11 plus encoded rows: a feed's ``encoded`` room, a hello's
# and a trainer heartbeat's ``encode`` share, ``spoiled``; version 11 was 10 plus where a feed's
# ``data`` is and its ``pipeline``; version 10 was 9 plus a start's weight ``changes``;
# version 9 was 8 plus a feed's named ``sources`` and their sizes, and a
# hello's mixture ``weights`` and ``epoch_samples``;
# version 8 was 7 plus a trainer heartbeat's ``pulls``;
# version 7 was 6 plus a trainer heartbeat's ``waited`` and ``computed``;
# version 6 was 5 plus a feed's ``decoding`` words and a start's ``offset``;
# version 5 was 4 plus picked starts and ``want``; version 4 was 3 plus
# acknowledged delivery: per-session lease numbers,
# ``ack``, a heartbeat's ``sent`` and ``run``, a resuming hello's ``have``; and a hello's
# ``group_secret``): any change here is a wire change, which needs a new PROTOCOL_VERSION.
GOLDEN: list[tuple[Message, str]] = [
    (Want(4, (10, 11)), "85a1760ca16ba477616e74a372756e04a473657173920a0ba5746f6b656ea0"),
    (
        Start(3, 2, 0, "tcp", True, (0, 5, 9)),
        "8ba1760ca16ba57374617274a372756e03a565706f636802a8706f736974696f6e00a97472616e73706f7274a3746370a670"
        "69636b6564c3a477616e7493000509a5746f6b656ea0a66f666673657400a76368616e67657390",
    ),
    (
        BatchReady(1, 2, 3, 4, 5, 64),
        "88a1760ca16ba56261746368a372756e01a565706f636802a373657103a56c6561736504a4736c6f7405a5636f756e7440",
    ),
    (Release((1, 2, 3)), "84a1760ca16ba772656c65617365a66c656173657393010203a5746f6b656ea0"),
    (
        TaskDone(1, 2, 3, ((4, "empty file"),)),
        # ``retry`` (empty) was added with object stores: a worker is always its service's version
        "88a1760ca16ba4646f6e65a47461736b01a6776f726b657202a5636f756e7403a3626164919204aa656d7074792066696c65"
        "a57265747279a0a7656e636f64656400",
    ),
    (
        Task(1, 0, 2, 3, bytes(8)),
        "89a1760ca16ba47461736ba47461736b01a46665656400a4736c6f7402a565706f636803a7696e6469636573c40800000000"
        "00000000a3726f7700a6656e636f646500",
    ),
    (
        ErrorReply("bad", "why", True),
        "85a1760ca16ba56572726f72a4636f6465a3626164a76d657373616765a3776879a5666174616cc3",
    ),
    (Bye(), "83a1760ca16ba3627965a5746f6b656ea0"),
    (
        Spoiled(((3, "bad data"),)),
        "84a1760ca16ba773706f696c6564a773616d706c6573919203a86261642064617461a5746f6b656ea0",
    ),
    (
        Hello("host:1", 1, "train", 6, held=(7,)),
        "de0015a1760ca16ba568656c6c6fa6636c69656e74a6686f73743a31a370696401a466656564a5747261696ea76372656469"
        "747306a46d6f6465a57368617264a472616e6b00aa776f726c645f73697a6501a972656d61696e646572a3706164a567726f"
        "7570a0aa67726f75705f73697a6501aa62617463685f73697a6500aa696d6167655f73697a6500a6726573756d65a0a46865"
        "6c649107a46861766500ac67726f75705f736563726574a0a77765696768747390ad65706f63685f73616d706c657300a665"
        "6e636f646500",
    ),
    (
        Heartbeat(sent=9, run=2),
        "89a1760ca16ba9686561727462656174a5746f6b656ea0a473656e7409a372756e02a677616974656400a8636f6d70757465"
        "6400a570756c6c7300a6656e636f6465ff",
    ),
    (
        Heartbeat("t", waited=1500, computed=2**40),
        "89a1760ca16ba9686561727462656174a5746f6b656ea174a473656e7400a372756effa6776169746564cd05dca8636f6d70"
        "75746564cf0000010000000000a570756c6c7300a6656e636f6465ff",
    ),
    (
        Heartbeat("t", waited=2, computed=3, pulls=4),
        "89a1760ca16ba9686561727462656174a5746f6b656ea174a473656e7400a372756effa677616974656402a8636f6d707574"
        "656403a570756c6c7304a6656e636f6465ff",
    ),
    (Ack(5, (7,), (4,)), "86a1760ca16ba361636ba46861766505a76d697373696e679107a468656c649104a5746f6b656ea0"),
    (
        Welcome("s1", FEED, 1.0, 2, 100),
        "89a1760ca16ba777656c636f6d65a773657373696f6ea27331a466656564de0013a46e616d65a5747261696ea773616d706c"
        "657364a7636c61737365730aaa62617463685f73697a6540aa696d6167655f73697a65cce0b1626174636865735f7065725f"
        "65706f636802a47365656400a76175676d656e74a5747261696eab66696e6765727072696e74d92061626162616261626162"
        "61626162616261626162616261626162616261626162a77365676d656e74b46461746166657272792d312d747261696e2d30"
        "30a5736c6f74730ca66669656c64739293a5696d616765a575696e74389303cce0cce093a56c6162656ca5696e74363490a5"
        "636865636ba0a86465636f64696e67a0a7736f757263657390ac736f757263655f73697a657390a464617461a0a870697065"
        "6c696e65a0a7656e636f64656400b26865617274626561745f696e74657276616ccb3ff0000000000000a762617463686573"
        "02a773616d706c657364a5746f6b656ea0a763726564697473cd0400",
    ),
]


@pytest.mark.parametrize(("msg", "golden"), GOLDEN, ids=lambda x: getattr(x, "KIND", ""))
def test_frames_are_byte_identical_to_the_pinned_version(msg: Message, golden: str) -> None:
    assert encode(msg).hex() == golden
    assert decode(bytes.fromhex(golden), ALL) == msg


def test_fields_added_later_may_be_absent_but_no_other_field_may() -> None:
    body = msgpack.unpackb(encode(Hello("host:1", 1, held=(3,))))
    del body["resume"], body["held"]
    assert decode(msgpack.packb(body), (Hello,)) == Hello("host:1", 1)
    del body["group"]
    with pytest.raises(ProtocolError, match="field 'group' is missing"):
        decode(msgpack.packb(body), (Hello,))


START_REST = {"transport": "shm", "picked": False, "want": [], "token": ""}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"k": "start", "run": 1, "epoch": 0, "position": 0, **START_REST, "extra": 1},
            "field 'extra' is not part",
        ),
        (
            {"k": "start", "run": 1, "epoch": 0, "position": 0, **START_REST, b"raw": 1},
            r"field b'raw' is not part",
        ),
        ({"k": "start", "run": 1, "epoch": 2**64 - 1, "position": 0}, "field 'epoch' must be an integer"),
        ({"k": "start", "run": 1.0, "epoch": 0, "position": 0}, "field 'run' must be an integer"),
        ({"k": "error", "code": "x", "message": "y", "fatal": 1}, "field 'fatal' must be a boolean"),
        ({"k": "hello", "client": "x", "pid": 1, "feed": "", "credits": 2, "mode": ["shard"]}, "'mode'"),
        ({"k": "release", "leases": [1, True]}, "item 1 of field 'leases'"),
        (
            {"k": "done", "task": 1, "worker": 0, "count": 0, "bad": [[1, 2]]},
            "item 1 of item 0 of field 'bad'",
        ),
        ({"k": "done", "task": 1, "worker": 0, "count": 0, "bad": [{"a": [1]}]}, "item 0 of field 'bad'"),
        ({"k": "heartbeat", "token": {"nested": [[[]]]}}, "field 'token' must be a string"),
        ({"k": "status", "body": [1]}, "field 'body' must be a map"),
        (
            {"k": "welcome", "session": "s", "feed": {"name": 1}, "heartbeat_interval": 1.0},
            "field 'name' of field 'feed' must be a string",
        ),
        (
            {"k": "welcome", "session": "s", "feed": {}, "heartbeat_interval": 1.0},
            "'name' of field 'feed' is",
        ),
        ({"v": True, "k": "bye"}, "protocol version"),
        (
            {
                "k": "hello",
                "client": "x",
                "pid": 1,
                "feed": "",
                "credits": 2,
                "mode": "shard",
                "rank": 2,
                "world_size": 2,
                "remainder": "pad",
                "group": "",
                "group_size": 1,
                "batch_size": 0,
                "image_size": 0,
            },
            "field 'rank' must be below 'world_size'",
        ),
    ],
)
def test_hostile_fields_are_refused_naming_the_field(fields: dict[Any, Any], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True), MESSAGE_TYPES)


def strategy_for(rule: object) -> st.SearchStrategy[Any]:
    """Values that ``rule`` accepts, sized to keep every frame below MAX_FRAME_BYTES."""
    match rule:
        case Int(lo, hi):
            return st.integers(lo, hi)
        case Float(lo, hi):
            return st.floats(lo, hi)
        case Str(max_len):
            return st.text(max_size=max_len)
        case OneOf(choices):
            return st.sampled_from(choices)
        case Bool():
            return st.booleans()
        case PackedInt64():
            return st.lists(st.binary(min_size=8, max_size=8), max_size=64).map(b"".join)
        case ListOf(item, max_len):
            return st.lists(strategy_for(item), max_size=min(max_len, 64)).map(tuple)
        case Pair(first, second):
            return st.tuples(strategy_for(first), strategy_for(second))
        case Items(rules):
            return st.tuples(*(strategy_for(r) for r in rules))
        case AnyMap():
            return st.dictionaries(st.text(max_size=8), values_without_tuples, max_size=4)
    raise AssertionError(f"no strategy for {rule!r}")


def records(cls: type) -> st.SearchStrategy[Any]:
    """Instances of the message (or nested record) ``cls`` with every field drawn from its rule."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {}
    for f in dataclasses.fields(cls):
        rules = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Rule)]
        fields[f.name] = strategy_for(rules[0]) if rules else records(hints[f.name])
    built = st.builds(cls, **fields)
    return built.filter(lambda h: h.rank < h.world_size) if cls is Hello else built


values_without_tuples = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.KIND)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(records(cls))
    frame = encode(msg)
    assert decode(frame, (cls,)) == msg
    assert encode(decode(frame, (cls,))) == frame


map_keys = st.text(max_size=8) | st.binary(max_size=4) | st.integers(-(2**63), 2**64 - 1) | st.none()
msgpack_objects = st.recursive(
    scalars | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(map_keys, inner, max_size=4),
    max_leaves=16,
)
# Past the envelope: a known kind with junk fields, keys of any type msgpack can carry.
junk_messages = st.builds(
    lambda kind, junk: {**junk, "v": PROTOCOL_VERSION, "k": kind},
    st.sampled_from([cls.KIND for cls in MESSAGE_TYPES]),
    st.dictionaries(map_keys, msgpack_objects, max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(msgpack_objects | junk_messages)
def test_random_msgpack_objects_only_ever_raise_protocol_error(obj: object) -> None:
    try:
        decode(msgpack.packb(obj, use_bin_type=True), MESSAGE_TYPES)
    except ProtocolError:
        pass


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.KIND)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_spoiled_field_is_refused_by_name(cls: type[Message], data: st.DataObject) -> None:
    body = msgpack.unpackb(encode(data.draw(records(cls))))
    names = [k for k in body if k not in ("v", "k")]
    action = data.draw(st.sampled_from(["replace", "delete", "add"] if names else ["add"]))
    if action == "add":
        name = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in body))
        body[name] = data.draw(values)
    else:
        name = data.draw(st.sampled_from(names))
        if action == "delete":
            del body[name]
        else:
            body[name] = data.draw(values)  # maps with str keys only: others fail at unpacking
    try:
        decode(msgpack.packb(body, use_bin_type=True), (cls,))
    except ProtocolError as exc:
        assert repr(name)[:60] in str(exc)
    else:
        assert action != "add", "an unknown field was accepted"


@dataclass(frozen=True)
class _NoRule:
    x: int


@dataclass(frozen=True)
class _TwoRules:
    x: Annotated[int, Int(), Int(0, 1)]


@dataclass(frozen=True)
class _OmittableWithoutDefault:
    x: Annotated[int, Int(), OMITTABLE]


@dataclass(frozen=True)
class _NeedsInit:
    x: Annotated[int, Int()]

    def __post_init__(self) -> None:
        pass


@pytest.mark.parametrize("cls", [_NoRule, _TwoRules, _OmittableWithoutDefault, _NeedsInit])
def test_declarations_the_decoder_cannot_honour_fail_at_import(cls: type) -> None:
    with pytest.raises(TypeError):
        Record(cls)


def test_a_wide_map_is_refused_from_its_header_not_built_and_checked() -> None:
    """A 46 KB frame of 6000 keys cost about 1.7 ms to build and refuse by name."""
    wide = {"v": PROTOCOL_VERSION, "k": "release", **{str(i): i for i in range(6000)}}
    with pytest.raises(ProtocolError, match="exceeds max_map_len"):
        decode(msgpack.packb(wide), ALL)


def test_the_diagrams_name_only_fields_their_messages_have() -> None:
    """The session diagram of ``protocol.messages`` against the dataclasses (``done`` once lacked
    ``retry``, ``heartbeat`` its loop totals, and ``welcome`` named fields that do not exist)."""
    kinds = {
        cls.KIND: {f.name for f in dataclasses.fields(cls)}
        for module in (messages, workers)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, messages.Message) and cls.KIND
    }
    doc = messages.__doc__ or ""
    named = re.findall(r"\b(\w+\??)\{([^}]*)\}", doc)
    assert {kind for kind, _ in named} >= {"hello", "welcome", "start", "batch", "heartbeat", "task", "done"}
    for kind, inside in named:
        names = {re.sub(r"[\[\]]|=.*", "", n).strip() for n in inside.split(",")} - {""}
        assert names <= kinds[kind], f"{kind}{{...}} names {sorted(names - kinds[kind])}, not its fields"
    frames = len(SlotLayout.images(4, 8).parts(4))
    assert "one per field" in doc and frames == len(image_fields(8)) + 1, (
        "a frame per field, then the indices"
    )
