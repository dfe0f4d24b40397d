"""Encoded rows, pure parts (issue 46): the table row's bounds (a peer wrote it), which rows a share
picks, the room in a slot, what a worker leaves encoded, and the rule that finds the split."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from gpu_worker.connection import ServiceError
from gpu_worker.delivery import Delivery
from gpu_worker.leases import LeaseBook
from gpu_worker.loop_clock import LoopClock
from gpu_worker.row_decoder import RowDecoder
from gpu_worker.split import BUSY, FIRST_STEP, LEAST_STEP, MOST_WAITS, Split, Window
from loader_service.decode.transforms import Recipe, load_bytes_into, plan_row
from protocol.encoded import COLUMNS, EVAL, MAX_SHARE, TRAIN, BadRow, EncodedRow, encoded_rows
from protocol.layout import PAGE, FieldSpec, SlotLayout, image_fields
from protocol.messages import FeedInfo
from protocol.pixels import DecodeError, regions
from protocol.pixels.render import render
from tests.unit.test_jpegcrop import photo_jpeg

GOOD = EncodedRow(100, 5000, TRAIN, True, 480, 640, 10, 20, 300, 400, 4, "area")


def test_a_row_round_trips_through_its_columns() -> None:
    assert EncodedRow.check(GOOD.columns(), 5100) == GOOD


@pytest.mark.parametrize(
    ("column", "value", "area", "says"),
    [
        (0, -1, 10_000, "outside the"),  # offset before the area
        (1, 0, 10_000, "outside the"),  # no bytes
        (1, 6000, 5_100, "outside the"),  # past the area's end
        (2, 3, 10_000, "not a known one"),  # mode
        (3, 2, 10_000, "not a known one"),  # a flag bit nobody defined
        (10, 3, 10_000, "not a known one"),  # a DCT scale libjpeg-turbo has no fast path for
        (11, 9, 10_000, "not a known one"),  # filter
        (4, 0, 10_000, "an image of"),
        (5, 1 << 22, 10_000, "an image of"),  # 480 x 4M pixels: over MAX_PIXELS
        (6, 200, 10_000, "outside 480 x 640"),  # the region's bottom past the image
        (9, 700, 10_000, "outside 480 x 640"),
        (7, -5, 10_000, "a region at"),
    ],
)
def test_every_column_a_peer_wrote_is_bounded(column: int, value: int, area: int, says: str) -> None:
    cols = list(GOOD.columns())
    cols[column] = value
    with pytest.raises(BadRow, match=says):
        EncodedRow.check(cols, area)
    with pytest.raises(BadRow, match="columns"):
        EncodedRow.check(cols[:-1], area)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("share", [0, 1, 250, 500, 999, 1000])
def test_a_share_picks_that_many_rows_spread_over_the_batch(rows: int, share: int) -> None:
    picked = encoded_rows(share, rows)
    assert sum(picked) == rows * share // MAX_SHARE
    assert encoded_rows(share, rows) == picked, "the same answer for the same numbers"
    if share == 500 and rows == 64:
        assert picked[:32].count(True) == 16, "spread, not the first half"


def test_the_room_follows_the_indices_and_a_layout_without_it_is_unchanged() -> None:
    plain = SlotLayout(64, image_fields(224))
    roomy = SlotLayout(64, image_fields(224), 150_000)
    assert plain.stride == SlotLayout.images(64, 224).stride and plain.encoded_area == 0
    assert roomy.table_offset >= roomy.indices_offset + 8 * 64 and roomy.table_offset % 64 == 0
    assert roomy.bytes_offset == roomy.table_offset + 8 * COLUMNS * 64
    assert roomy.stride % PAGE == 0 and roomy.stride >= roomy.bytes_offset + 64 * 150_000
    with pytest.raises(ValueError, match="encoded row room"):
        SlotLayout(64, image_fields(224), -1)


@pytest.mark.parametrize("augment", ["train", "eval"])
@pytest.mark.parametrize("interpolation", ["bilinear-antialias", "bilinear", "area"])
def test_a_planned_row_rendered_elsewhere_is_the_row_the_service_writes(
    augment: str, interpolation: str
) -> None:
    """What the service would write, and what a trainer makes of the planned row: every byte."""
    data = photo_jpeg(450, 600, seed=11)
    recipe = Recipe(augment, interpolation, roi=True)
    service = np.empty((3, 64, 64), np.uint8)
    load_bytes_into(data, service, recipe, np.random.default_rng(3))
    planned = plan_row(data, 64, recipe, np.random.default_rng(3))
    assert planned is not None and planned.mode == (EVAL if augment == "eval" else TRAIN)
    trainer = np.empty((3, 64, 64), np.uint8)
    render(data, EncodedRow.check(planned.columns(), len(data)), trainer)
    assert np.array_equal(service, trainer)


def test_only_what_the_region_path_takes_is_planned() -> None:
    data = photo_jpeg(200, 300, seed=2)
    rng = np.random.default_rng(0)
    assert plan_row(data, 32, Recipe("none", roi=True), rng) is None, "no crop to carry"
    assert plan_row(data, 32, Recipe("train", roi=False), rng) is None, "--decoder opencv"
    assert plan_row(data[:-2], 32, Recipe("train", roi=True), rng) is None, "no EOI: OpenCV's to judge"


def window(wait: float, busy: float, images: int = 1000) -> Window:
    return Window(1.0, waited=wait, computed=1.0 - wait, images=images, busy=busy)


def test_the_split_moves_towards_the_side_with_room() -> None:
    split = Split(0, fixed=False)
    for _ in range(6):  # the loop waits, the threads idle: more rows come encoded
        split.observe(window(0.4, 0.2))
    assert split.share > 500
    high = split.share
    split.observe(window(0.4, BUSY + 0.1))  # the threads are the ceiling now: fewer
    assert split.share < high
    settled = split.share
    split.observe(window(0.0, 0.5))  # fed, threads with room: it holds
    assert split.share == settled


def test_a_step_followed_by_a_slower_loop_is_taken_back() -> None:
    split = Split(500, fixed=False)
    split.observe(window(0.3, 0.3, images=1000))
    assert split.share > 500
    split.observe(window(0.3, 0.3, images=800))  # 20 % fewer images a second
    assert split.share == 500


def test_a_fixed_split_never_moves_and_steps_shrink_on_reversals() -> None:
    fixed = Split(MAX_SHARE, fixed=True)
    assert fixed.observe(window(0.9, 0.0)) == MAX_SHARE
    split = Split(500, fixed=False)
    for turn in range(12):
        split.observe(window(0.3, 0.1 if turn % 2 else 0.95))
    assert split._step == LEAST_STEP and 0 < split.share < MAX_SHARE


def test_a_step_is_judged_only_once_the_service_applies_it() -> None:
    """The share reaches batches planned after the next heartbeat, behind those in flight: windows
    that do not see it yet neither take the step back nor move again."""
    split = Split(0, fixed=False)
    split.observe(replace(window(0.4, 0.2), realized=0.0))
    assert split.share == FIRST_STEP
    for _ in range(MOST_WAITS):  # slower windows, the step not at work: held, not taken back
        assert split.observe(replace(window(0.4, 0.2, images=500), realized=0.0)) == FIRST_STEP
    assert split.observe(replace(window(0.4, 0.2), realized=FIRST_STEP / MAX_SHARE)) > FIRST_STEP


def model_rate(s: float, service: float, threads: float, loop: float) -> float:
    return min(loop, service / (1 - s) if s < 1 else loop, threads / s if s > 0 else loop)


def two_decoders(
    split: Split, phases: list[tuple[float, float, float]], windows: int
) -> list[tuple[list[float], float]]:
    """A model of the loop the split steers: the service decodes ``service`` images a second, this
    process's threads ``threads``, the loop takes at most ``loop``; at share s the loop gets
    min(loop, service / (1 - s), threads / s). A share the split asks for reaches the rows two
    windows later (a heartbeat, then the batches already in flight). Per phase: each window's
    images a second over the best any share gives, and the better fixed extreme's over the best."""
    asked = [split.share / MAX_SHARE] * 2
    out = []
    for service, threads, loop in phases:
        rate = partial(model_rate, service=service, threads=threads, loop=loop)
        best = max(rate(k / MAX_SHARE) for k in range(MAX_SHARE + 1))
        seen = []
        for _ in range(windows):
            s = asked[0]
            images = rate(s)
            busy = min(1.0, images * s / threads)
            window = Window(1.0, 1 - images / loop, images / loop, round(images), busy, realized=s)
            asked = [asked[1], split.observe(window) / MAX_SHARE]
            seen.append(images / best)
        out.append((seen, max(rate(0.0), rate(1.0)) / best))
    return out


def test_the_split_settles_and_follows_a_change_of_either_side() -> None:
    """Both sides as fast; a neighbour takes half the service's cores; the trainer's threads lose
    half theirs; a model that is slower than either. In each phase, from the 10th window on, the
    loop averages 0.85 or more of the best share's pace (the rule keeps its threads under ``BUSY``
    and probes, so it sits below the best), and over the whole phase, finding the share included,
    it does no worse than 0.95 of the better fixed extreme (all rows on one side; 0.5 to 0.67 of
    the best in the first three phases, the best in the last)."""
    phases = [(600.0, 600.0, 2000.0), (300.0, 600.0, 2000.0), (600.0, 300.0, 2000.0), (600.0, 600.0, 500.0)]
    for (seen, extreme), phase in zip(two_decoders(Split(0, fixed=False), phases, 30), phases, strict=True):
        shown = (phase, [round(x, 2) for x in seen])
        assert sum(seen[10:]) / len(seen[10:]) >= 0.85, shown
        assert sum(seen) / len(seen) >= 0.95 * extreme, shown


def test_a_small_step_is_not_judged_by_windows_from_before_it() -> None:
    """A step of a few thousandths: a window whose rows still show the share before it (nearer the
    old share than the new) neither takes it back nor moves again, however slow it was."""
    split = Split(500, fixed=False)
    for turn in range(12):  # reversals shrink the step to its least
        split.observe(window(0.3, 0.1 if turn % 2 else 0.95))
    before = split.share
    split.observe(replace(window(0.3, 0.1), realized=before / MAX_SHARE))
    stepped = split.share
    assert 0 < stepped - before <= 2 * LEAST_STEP, "a step well under a tenth"
    stale = replace(window(0.3, 0.1, images=500), realized=before / MAX_SHARE)
    assert split.observe(stale) == stepped, "half the images, but from rows planned before the step"
    assert split.observe(replace(window(0.3, 0.1), realized=stepped / MAX_SHARE)) > stepped


def test_a_trainer_without_the_region_decoder_takes_no_encoded_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(regions, "_jpegcrop", None)
    decoder = RowDecoder("trainer", 1, LoopClock())
    assert not decoder.takes_encoded and decoder.share == -1 and "libjpeg" in decoder.unable
    decoder.close()


def encoded_feed(fields: tuple[FieldSpec, ...], decoding: str = "") -> FeedInfo:
    layout = SlotLayout(4, fields, 4096)
    return FeedInfo(
        "train", 10, 2, 4, 8, 3, 0, "train", "ff" * 16, "dataferry-not-mapped", 2, layout.wire(), "",
        decoding, encoded=4096,
    )  # fmt: skip


def test_a_feed_offering_encoded_rows_without_an_image_field_is_refused() -> None:
    delivery = Delivery(torch.device("cpu"), "tcp", LeaseBook(), RowDecoder("trainer", 1, LoopClock()))
    with pytest.raises(ServiceError, match="without an image field"):
        delivery.adopt(encoded_feed((FieldSpec("x", "float32", (3, 8, 8)), FieldSpec("label", "int64", ()))))
    delivery.adopt(encoded_feed(image_fields(8), "max-pixels=1000 interpolation=area"))
    assert delivery._max_pixels == 1000, "no encoded row may name an image the service would refuse"
    delivery.close()


def test_a_row_whose_image_is_not_the_one_its_bytes_hold_is_refused_before_decoding() -> None:
    """The trainer reads the header again: a row naming another size than the bytes' is bad."""
    data = photo_jpeg(200, 300, seed=4)
    planned = plan_row(data, 32, Recipe("train", roi=True), np.random.default_rng(1))
    assert planned is not None
    lying = replace(planned, height=planned.height - 8)
    with pytest.raises(DecodeError, match="its header says 200 x 300"):
        render(data, lying, np.empty((3, 32, 32), np.uint8))
    with pytest.raises(DecodeError, match="not a JPEG the region decoder takes"):
        render(b"\x89PNG" + data[4:], planned, np.empty((3, 32, 32), np.uint8))
