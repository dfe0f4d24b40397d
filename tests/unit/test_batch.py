"""A trainer's ``Batch``: named fields over a real shared-memory slot or real ZeroMQ frames.

The slot tests map a real segment as a trainer does (``Delivery`` and ``SlotMap``), write a batch
into it as a decode worker would, and check what the loop receives: the values, which fields view
the slot and which are copies, and when the lease ends. The frame tests send the slot's parts over a
real socket, as the service does for a trainer on another host (``SlotLayout.parts``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
import zmq

from gpu_worker.batch import SMALL_ROW_BYTES, Batch, frame_fields, slot_fields
from gpu_worker.connection import ServiceError
from gpu_worker.delivery import Delivery
from gpu_worker.fields import as_expected, expected_fields, field_differences
from gpu_worker.leases import LeaseBook
from gpu_worker.mapping import SlotMap
from protocol.layout import PAGE, FieldSpec, SlotLayout, describe_fields
from protocol.messages import BatchReady, FeedInfo
from tests.helpers import shm_segment

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
"""A service's socket and a trainer's, connected."""
Parts = list[bytes | memoryview]
"""A batch's data frames as the service sends them."""
Damage = Callable[[Parts], Parts]
CAPACITY = 4
SLOTS = 2
CHECK = bytes(range(16))
BUILT_IN = SlotLayout.images(CAPACITY, 8)
PIPELINE = SlotLayout(
    CAPACITY,
    (
        FieldSpec("image", "float16", (3, 6, 6)),
        FieldSpec("mask", "bool", (8, 8)),  # 64 bytes a row: exactly the copy limit
        FieldSpec("label", "int64", ()),
        FieldSpec("box", "float32", (4,)),
        FieldSpec("tokens", "int32", (17,)),  # 68 bytes a row: just over it, a view
    ),
)


@contextlib.contextmanager
def segment(layout: SlotLayout, slots: int = SLOTS) -> Iterator[str]:
    """A real segment of ours with ``slots`` slots of ``layout`` and the check page after them."""
    pool = layout.segment_bytes(slots)

    def write(m: mmap.mmap) -> None:
        m[pool : pool + len(CHECK)] = CHECK

    with shm_segment("batch", layout.mapped_bytes(slots), write) as name:
        yield name


def sample_rows(layout: SlotLayout, count: int, salt: int = 0) -> dict[str, npt.NDArray[np.generic]]:
    """Distinct values for rows ``[0, count)`` of every field: what a decode worker would write."""
    rng = np.random.default_rng(salt)
    out: dict[str, npt.NDArray[np.generic]] = {}
    for spec in layout.fields:
        shape = (count, *spec.shape)
        if spec.dtype == "bool":
            out[spec.name] = rng.random(shape) < 0.5
        else:
            out[spec.name] = (rng.random(shape) * 100).astype(spec.dtype)
    return out


def write_slot(
    name: str, layout: SlotLayout, slot: int, rows: dict[str, npt.NDArray[np.generic]], indices: list[int]
) -> None:
    """Write ``rows`` and ``indices`` into ``slot`` of the segment, through a mapping of its own."""
    fd = os.open(Path("/dev/shm") / name, os.O_RDWR)
    try:
        with mmap.mmap(fd, layout.segment_bytes(SLOTS)) as m:
            start = slot * layout.stride
            for spec, offset in zip(layout.fields, layout.offsets, strict=True):
                data = np.ascontiguousarray(rows[spec.name]).tobytes()
                m[start + offset : start + offset + len(data)] = data
            data = np.asarray(indices, np.int64).tobytes()
            m[start + layout.indices_offset : start + layout.indices_offset + len(data)] = data
    finally:
        os.close(fd)


def feed_info(layout: SlotLayout, segment_name: str) -> FeedInfo:
    return FeedInfo(
        "train", 100, 0, layout.capacity, 0, 25, 0, "none", "ff" * 16, segment_name, SLOTS,
        layout.wire(), CHECK.hex(),
    )  # fmt: skip


def views_memory(t: torch.Tensor, base: int, nbytes: int) -> bool:
    return base <= t.data_ptr() < base + nbytes


def released(book: LeaseBook) -> list[int]:
    sent: list[int] = []

    def send(msg: object) -> bool:
        sent.extend(msg.leases)  # type: ignore[attr-defined]
        return True

    book.flush(1, send)
    return sent


# --- Batch as a mapping and a tuple --------------------------------------------------------------


def make_batch() -> Batch:
    fields = {"image": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "label": torch.tensor([3, 5])}
    return Batch(fields, torch.tensor([10, 11]), epoch=2, seq=7)


def test_a_batch_unpacks_as_its_fields_in_order_and_maps_their_names() -> None:
    batch = make_batch()
    images, labels = batch
    assert images is batch["image"] is batch[0] is batch.images
    assert labels is batch["label"] is batch[1] is batch.labels
    assert len(batch) == 2 and list(batch.keys()) == ["image", "label"]
    assert "label" in batch and "mask" not in batch
    assert dict(batch) == batch.fields == dict(batch.items())
    assert [t.data_ptr() for t in batch.values()] == [images.data_ptr(), labels.data_ptr()]
    assert batch.get("mask") is None
    assert (batch.epoch, batch.seq, batch.indices.tolist()) == (2, 7, [10, 11])

    def step(image: torch.Tensor, label: torch.Tensor) -> int:
        return int(label.sum())

    assert step(**batch) == step(*batch) == 8


def test_fields_is_a_new_dict_each_time() -> None:
    batch = make_batch()
    batch.fields.pop("image")
    assert list(batch.fields) == ["image", "label"]


def test_images_and_labels_name_the_fields_when_they_are_absent() -> None:
    batch = Batch({"pixels": torch.zeros(1, 2)}, torch.tensor([0]), 0, 0)
    with pytest.raises(AttributeError, match=r"no field 'image'; they have pixels"):
        _ = batch.images
    with pytest.raises(AttributeError, match=r"no field 'label'"):
        _ = batch.labels
    with pytest.raises(KeyError):
        batch["image"]


def test_repr_names_every_field() -> None:
    assert repr(make_batch()) == "Batch(epoch=2, seq=7, image=uint8[2, 3, 4, 4], label=int64[2])"


# --- shared memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [BUILT_IN, PIPELINE], ids=["built-in", "pipeline"])
def test_slot_fields_hold_what_was_written_views_for_large_rows_copies_for_small(layout: SlotLayout) -> None:
    count = 3  # a short batch: stale rows beyond it must not show
    rows = sample_rows(layout, count, salt=1)
    with segment(layout) as name:
        write_slot(name, layout, 1, rows, [7, 3, 9])
        pool = SlotMap(name, layout, SLOTS, CHECK.hex())
        owner = pool.slot(1)
        fields, indices = slot_fields(memoryview(owner), layout, count)
        del owner
        assert list(fields) == list(layout.names)
        for spec in layout.fields:
            t = fields[spec.name]
            assert t.dtype == getattr(torch, spec.dtype) and tuple(t.shape) == (count, *spec.shape)
            assert np.array_equal(t.numpy(), rows[spec.name]), spec.name
            big = spec.row_bytes > SMALL_ROW_BYTES
            assert views_memory(t, pool.address, pool.nbytes) == big, f"{spec.name}: view iff rows are big"
        assert indices.tolist() == [7, 3, 9] and not views_memory(indices, pool.address, pool.nbytes)
        del fields, indices
        pool.close()


def test_a_write_to_the_slot_shows_in_a_large_field_not_in_a_small_one() -> None:
    rows = sample_rows(BUILT_IN, CAPACITY)
    with segment(BUILT_IN) as name:
        write_slot(name, BUILT_IN, 0, rows, list(range(CAPACITY)))
        pool = SlotMap(name, BUILT_IN, SLOTS, CHECK.hex())
        fields, _ = slot_fields(memoryview(pool.slot(0)), BUILT_IN, CAPACITY)
        write_slot(name, BUILT_IN, 0, sample_rows(BUILT_IN, CAPACITY, salt=9), [0] * CAPACITY)
        assert not np.array_equal(fields["image"].numpy(), rows["image"]), "image is the slot itself"
        assert np.array_equal(fields["label"].numpy(), rows["label"]), "label was copied out"
        del fields
        pool.close()


def test_the_lease_lasts_while_any_large_field_lives_and_no_longer() -> None:
    book = LeaseBook()
    delivery = Delivery(torch.device("cpu"), "shm", book)
    with segment(PIPELINE) as name:
        rows = sample_rows(PIPELINE, 2)
        write_slot(name, PIPELINE, 0, rows, [1, 2])
        delivery.adopt(feed_info(PIPELINE, name))
        assert delivery.transport == "shm" and delivery.batch_bytes == 0
        batch = delivery.wrap(BatchReady(1, 0, 0, 5, 0, 2), (1, 5), None)
        image, tokens, label, mask = batch["image"], batch["tokens"][1:], batch["label"], batch["mask"]
        del batch
        gc.collect()
        assert book.held() == 1 and released(book) == []
        del image
        assert released(book) == [], "a slice of tokens still views the slot"
        del tokens
        assert released(book) == [5], "the last view is gone; label and mask are copies"
        write_slot(name, PIPELINE, 0, sample_rows(PIPELINE, 2, salt=5), [0, 0])  # the slot is reused
        assert np.array_equal(label.numpy(), rows["label"]) and np.array_equal(mask.numpy(), rows["mask"])
        delivery.close()


def test_a_slot_outside_the_pool_is_a_service_error() -> None:
    delivery = Delivery(torch.device("cpu"), "shm", LeaseBook())
    with segment(BUILT_IN) as name:
        delivery.adopt(feed_info(BUILT_IN, name))
        with pytest.raises(ServiceError, match="invalid slot"):
            delivery.wrap(BatchReady(1, 0, 0, 5, SLOTS, 2), (1, 5), None)
        delivery.close()


def test_an_unusable_layout_in_the_welcome_is_a_service_error() -> None:
    info = feed_info(BUILT_IN, "dataferry-unused")
    bad = dataclasses.replace(info, fields=(("image", "uint8", (3, 8, 8)), ("image", "int64", ())))
    with pytest.raises(ServiceError, match=r"unusable slot layout: field names repeat"):
        Delivery(torch.device("cpu"), "shm", LeaseBook()).adopt(bad)


# --- frames (tcp) --------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[Pair]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    service, trainer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    endpoint = f"inproc://batch-{os.urandom(4).hex()}"
    service.bind(endpoint)
    trainer.connect(endpoint)
    try:
        yield service, trainer
    finally:
        service.close(linger=0)
        trainer.close(linger=0)
        ctx.term()


def slot_bytes(layout: SlotLayout, rows: dict[str, npt.NDArray[np.generic]], indices: list[int]) -> bytearray:
    """One slot's bytes as the service holds them."""
    slot = bytearray(layout.stride)
    for spec, offset in zip(layout.fields, layout.offsets, strict=True):
        data = np.ascontiguousarray(rows[spec.name]).tobytes()
        slot[offset : offset + len(data)] = data
    data = np.asarray(indices, np.int64).tobytes()
    slot[layout.indices_offset : layout.indices_offset + len(data)] = data
    return slot


def received(pair: Pair, parts: Parts) -> list[zmq.Frame]:
    service, trainer = pair
    service.send_multipart([b"header", *parts], copy=False)
    assert trainer.poll(10_000)
    return trainer.recv_multipart(copy=False)[1:]


def parts_of(layout: SlotLayout, slot: bytearray, count: int) -> Parts:
    """What the service sends for rows ``[0, count)`` of ``slot``: ``layout.parts(count)``."""
    whole = memoryview(slot)
    return [whole[offset : offset + nbytes] for offset, nbytes in layout.parts(count)]


@pytest.mark.parametrize("layout", [BUILT_IN, PIPELINE], ids=["built-in", "pipeline"])
def test_frames_give_the_same_fields_as_the_slot(layout: SlotLayout, pair: Pair) -> None:
    count = 3
    rows = sample_rows(layout, count, salt=2)
    frames = received(pair, parts_of(layout, slot_bytes(layout, rows, [4, 0, 2]), count))
    fields, indices = frame_fields(frames, layout, count)
    for spec, frame in zip(layout.fields, frames[:-1], strict=True):
        t = fields[spec.name]
        assert t.dtype == getattr(torch, spec.dtype) and tuple(t.shape) == (count, *spec.shape)
        assert np.array_equal(t.numpy(), rows[spec.name]), spec.name
        address = np.frombuffer(frame.buffer, np.uint8).ctypes.data
        viewed = views_memory(t, address, len(frame.buffer))
        assert viewed == (spec.row_bytes > SMALL_ROW_BYTES), f"{spec.name}: view iff rows are big"
    assert indices.tolist() == [4, 0, 2]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda parts: parts[:-1], r"2 data frames where 2 fields and the indices take 3"),
        (lambda parts: [*parts, b""], r"4 data frames where"),
        (lambda parts: [parts[0][:-1], *parts[1:]], r"frame 'image' holds 767 bytes where 4 rows take 768"),
        (lambda parts: [parts[0], b"x" * 24, parts[2]], r"frame 'label' holds 24 bytes where 4 rows take 32"),
        (lambda parts: [*parts[:2], b"x" * 33], r"frame 'indices' holds 33 bytes"),
        (lambda parts: [b"", b"", b""], r"frame 'image' holds 0 bytes"),
    ],
    ids=["too-few", "too-many", "short-image", "short-label", "odd-indices", "empty"],
)
def test_frames_that_do_not_match_the_layout_are_refused(pair: Pair, damage: Damage, message: str) -> None:
    rows = sample_rows(BUILT_IN, CAPACITY)
    parts = parts_of(BUILT_IN, slot_bytes(BUILT_IN, rows, [0, 1, 2, 3]), CAPACITY)
    frames = received(pair, damage(parts))
    with pytest.raises(ValueError, match=message):
        frame_fields(frames, BUILT_IN, CAPACITY)


def test_a_frame_lease_lasts_while_any_frame_is_viewed(
    pair: Pair,
) -> None:
    book = LeaseBook()
    delivery = Delivery(torch.device("cpu"), "tcp", book)
    delivery.adopt(feed_info(PIPELINE, "dataferry-not-mapped-over-tcp"))
    assert delivery.transport == "tcp"
    assert delivery.batch_bytes == sum(nbytes for _, nbytes in PIPELINE.parts(CAPACITY))
    rows = sample_rows(PIPELINE, 2, salt=3)
    frames = received(pair, parts_of(PIPELINE, slot_bytes(PIPELINE, rows, [5, 6]), 2))
    batch = delivery.wrap(BatchReady(1, 0, 0, 8, 0, 2), (1, 8), frames)
    del frames
    assert np.array_equal(batch["box"].numpy(), rows["box"]) and batch.indices.tolist() == [5, 6]
    image, tokens = batch["image"], batch["tokens"]
    del batch
    assert released(book) == []
    del image  # the first frame: the lease is not its alone
    assert released(book) == [], "the tokens frame is still viewed"
    del tokens
    assert released(book) == [8]
    delivery.close()


def test_malformed_frames_are_a_service_error(pair: Pair) -> None:
    book = LeaseBook()
    delivery = Delivery(torch.device("cpu"), "tcp", book)
    delivery.adopt(feed_info(BUILT_IN, "dataferry-not-mapped-over-tcp"))
    frames = received(pair, [b"x" * 10, b"y" * 8, b"z" * 8])
    with pytest.raises(ServiceError, match=r"malformed batch from the service: frame 'image' holds 10"):
        delivery.wrap(BatchReady(1, 0, 0, 8, 0, 1), (1, 8), frames)
    with pytest.raises(ServiceError, match="arrived without its data"):
        delivery.wrap(BatchReady(1, 0, 1, 9, 0, 1), (1, 9), None)
    delivery.close()


def test_a_misaligned_frame_is_copied_not_viewed(pair: Pair) -> None:
    layout = SlotLayout(2, (FieldSpec("x", "float64", (40,)),))
    rows = sample_rows(layout, 2)
    frames = received(pair, parts_of(layout, slot_bytes(layout, rows, [0, 1]), 2))
    # The same bytes one past an aligned address: what a frame from an odd allocator would give.
    store = np.zeros(frames[0].buffer.nbytes + 8, np.uint8)
    start = 1 if store.ctypes.data % 8 == 0 else 0
    store[start : start + frames[0].buffer.nbytes] = np.frombuffer(frames[0].buffer, np.uint8)
    odd = store.data[start : start + frames[0].buffer.nbytes]

    class Odd:  # stands in for a zmq.Frame: only its buffer is read
        buffer = odd

    assert not np.frombuffer(odd, np.float64).flags.aligned
    fields, _ = frame_fields([Odd(), frames[1]], layout, 2)  # type: ignore[list-item]
    assert np.array_equal(fields["x"].numpy(), rows["x"]) and fields["x"].numpy().flags.aligned
    assert not views_memory(fields["x"], store.ctypes.data, store.nbytes)


# --- the fields a trainer expects ----------------------------------------------------------------


def test_expected_fields_take_torch_dtypes_or_their_names() -> None:
    specs = expected_fields({"image": ((3, 224, 224), torch.uint8), "label": ((), "int64")})
    assert specs == SlotLayout.images(1, 224).fields
    assert as_expected(specs) == {"image": ((3, 224, 224), torch.uint8), "label": ((), torch.int64)}
    assert describe_fields(specs) == "image uint8[3, 224, 224], label int64[]"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "non-empty dict"),
        ({"image": (3, 224, 224)}, r"fields\['image'\] must be \(shape, dtype\)"),
        ({"image": (224, torch.uint8)}, r"shape must be a tuple of sizes"),
        ({"image": ((3, 224, 224), torch.bfloat16)}, r"torch.bfloat16 is not a field dtype"),
        ({"image": ((3, 224, 224), "uint9")}, r"dtype 'uint9' is not one of"),
        ({"image": ((3, 0, 224), torch.uint8)}, r"shape \(3, 0, 224\)"),
        ({"2x": ((1,), torch.uint8)}, r"field name '2x'"),
        ({"image": ((3,), 8)}, r"dtype must be a torch.dtype or its name"),
    ],
)
def test_expected_fields_that_cannot_be_are_refused(fields: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expected_fields(fields)  # type: ignore[arg-type]


def test_field_differences_name_every_difference() -> None:
    served = (
        FieldSpec("image", "uint8", (3, 32, 32)),
        FieldSpec("label", "int64", ()),
        FieldSpec("aux", "float32", (2,)),
    )
    expected = expected_fields(
        {"image": ((3, 224, 224), torch.float16), "label": ((), torch.int64), "mask": ((8,), torch.bool)}
    )
    assert field_differences(expected, served) == [
        "missing field mask bool[8]",
        "extra field aux float32[2]",
        "image: shape [3, 32, 32], expected [3, 224, 224]",
        "image: dtype uint8, expected float16",
    ]
    assert field_differences(served, served) == []


def test_the_same_fields_in_another_order_differ_since_unpacking_would_swap_them() -> None:
    served = SlotLayout.images(1, 8).fields
    assert field_differences(served[::-1], served) == ["order image, label, expected label, image"]


def test_the_alignment_assumption_of_the_layout_holds() -> None:
    """Slot views are never misaligned: slots start on pages, fields on 64-byte boundaries."""
    assert PIPELINE.stride % PAGE == 0 and all(offset % 64 == 0 for offset in PIPELINE.offsets)
