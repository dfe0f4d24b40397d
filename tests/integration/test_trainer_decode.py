"""Encoded rows through real processes (issue 46): a trainer that decodes the JPEGs the service sends
as they are gets the same samples, labels and pixels as one the service decodes for; bad files cost
their row and are reported; a service that offers none is named; a remote trainer over CURVE takes
them too; ``auto`` finds a share."""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path
from typing import Any

import cv2
import pytest

from gpu_worker import ServiceError, ServiceLoader
from loader_service.supervisor.streams.early import WARM_BATCHES
from protocol.encoded import MAX_SHARE
from protocol.messages import Spoiled
from tests.helpers import ServiceFactory, free_port, job_steps, status, wait_until
from tests.integration.test_remote import Keys

pytestmark = pytest.mark.integration


def epoch(loader: ServiceLoader, number: int) -> dict[int, tuple[int, str]]:
    """Every sample of epoch ``number``: its label and a digest of its pixels."""
    loader.set_epoch(number)
    out: dict[int, tuple[int, str]] = {}
    for batch in loader:
        for i, label, image in zip(batch.indices.tolist(), batch.labels.tolist(), batch.images, strict=True):
            assert i not in out, f"sample {i} twice in epoch {number}"
            out[i] = (label, hashlib.sha1(image.numpy().tobytes()).hexdigest())
    return out


ROOM = 1 << 20
"""Bytes of room a row: every test photo fits, so which rows go encoded is the share alone."""


@pytest.mark.parametrize("augment", ["train", "eval"])
def test_rows_a_trainer_decodes_are_the_ones_the_service_would_have_made(
    photos: Path, start_service: ServiceFactory, augment: str
) -> None:
    """Same samples, labels and pixels (every byte: one function makes both) in two epochs; the
    trainer decoded every row but any of the warm start's (decoded before anyone asked; the first
    loader took them here)."""
    service = start_service(
        photos, batch_size=8, image_size=48, augment=augment, workers=2, encoded_row_bytes=ROOM
    )
    with ServiceLoader(service.endpoint, timeout=30) as theirs:
        expected = [epoch(theirs, e) for e in (0, 1)]
        assert theirs.stats()["decode"]["trainer_rows"] == 0
    with ServiceLoader(service.endpoint, timeout=30, decode="trainer", decode_threads=2) as ours:
        got = [epoch(ours, e) for e in (0, 1)]
        decode = ours.stats()["decode"]
    assert got == expected
    rows = 2 * len(expected[0])
    assert rows - WARM_BATCHES * 8 <= decode["trainer_rows"] <= rows, decode
    assert decode["trainer_rows"] + decode["service_rows"] == rows and decode["spoiled"] == 0, decode
    assert decode["share"] == 1.0 and decode["trainer_ms_per_image"] > 0, decode
    # and the next epoch's first batches, decoded ahead for it and never taken
    assert status(service.endpoint)["feeds"][0]["encoded_rows"] >= decode["trainer_rows"]


def test_a_share_sends_that_part_of_each_batch_encoded(photos: Path, start_service: ServiceFactory) -> None:
    """A share of a half, said in the heartbeats: about half the rows come encoded; the epoch is
    whole and exact."""
    service = start_service(photos, batch_size=8, image_size=32, workers=1, encoded_row_bytes=ROOM)
    with ServiceLoader(service.endpoint, timeout=30) as reference:
        expected = epoch(reference, 3)
    with ServiceLoader(service.endpoint, timeout=30, decode="trainer") as loader:
        loader._fleet.decoder.split.share = MAX_SHARE // 2
        wait_until(
            lambda: status(service.endpoint)["sessions"][0]["encode_share"] == 0.5, "the share arrived"
        )
        got = epoch(loader, 3)
        decode = loader.stats()["decode"]
    assert got == expected
    assert 0.4 * len(got) <= decode["trainer_rows"] <= 0.6 * len(got), decode


def undecodable(jpeg: bytes) -> bytes:
    """A JPEG whose header reads (size, components: what the service reads before sending it) but
    whose scan names a Huffman table the file never defines, so no decoder can decode its data."""
    scan = jpeg.index(b"\xff\xda")
    body = bytearray(jpeg)
    body[scan + 6] = 0x33  # the first component's DC and AC tables: 3, defined nowhere
    return bytes(body)


def test_a_file_whose_data_does_not_decode_costs_its_row_and_is_reported(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    """The service reads the header and sends the row; the trainer cannot decode it: the row is
    left out of its batch (the rest is delivered, exact), and the service logs and counts it as a
    bad file, as it does when its own worker fails on it."""
    data = tmp_path / "data"
    shutil.copytree(photos, data)
    victim = sorted(data.rglob("*.jpg"))[4]
    victim.write_bytes(undecodable(victim.read_bytes()))
    service = start_service(data, batch_size=8, image_size=32, workers=1, encoded_row_bytes=ROOM)
    with ServiceLoader(service.endpoint, timeout=30, decode="trainer") as loader:
        got = epoch(loader, 1)
        decode = loader.stats()["decode"]
    assert decode["spoiled"] == 1 and len(got) == 89, decode
    relative = str(victim.relative_to(data))
    wait_until(lambda: "decoded by trainer" in service.log, "the service logged the trainer's bad row")
    assert any(relative in line and "decoded by trainer" in line for line in service.log.splitlines())
    assert status(service.endpoint)["feeds"][0]["bad_files"] == 1
    with ServiceLoader(service.endpoint, timeout=30) as reference:
        assert epoch(reference, 1) == got, "the service's own decode refuses it too, and agrees on the rest"


def test_decode_trainer_of_a_feed_without_encoded_rows_names_both(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, batch_size=8, image_size=32, encoded_row_bytes=0)
    with pytest.raises(ServiceError, match=r"decode='trainer'.*sends no encoded rows.*--encoded-row-bytes 0"):
        ServiceLoader(service.endpoint, timeout=10, decode="trainer")
    with ServiceLoader(service.endpoint, timeout=10, decode="auto") as loader:
        assert len(epoch(loader, 0)) == 90


def pixels_of(batch: Any) -> list[tuple[int, str]]:
    return [
        (i, hashlib.sha1(image.numpy().tobytes()).hexdigest())
        for i, image in zip(batch.indices.tolist(), batch.images, strict=True)
    ]


def test_ranks_and_a_resume_at_another_world_size_take_encoded_rows_exactly_once(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Two ranks decoding their rows take 4 steps; the state resumes a job of three: across both
    every sample once but the few ``remainder="drop"`` leaves out, each with the service's pixels."""
    service = start_service(photos, batch_size=4, image_size=32, workers=2, encoded_row_bytes=ROOM)
    with ServiceLoader(service.endpoint, timeout=30) as reference:
        expected = epoch(reference, 0)
    first, state = job_steps(service.endpoint, 2, 4, rows=pixels_of, decode="trainer")
    rest, _ = job_steps(service.endpoint, 3, -1, state, rows=pixels_of, decode="trainer")
    taken = dict(first + rest)
    assert len(taken) == len(first) + len(rest), "no sample twice"
    left_out = (len(expected) - state["consumed"]) % 3
    assert len(taken) == len(expected) - left_out
    assert all(expected[i][1] == digest for i, digest in taken.items())
    assert status(service.endpoint)["feeds"][0]["encoded_rows"] >= len(taken) - 4 * 8


def test_a_remote_trainer_over_curve_takes_encoded_rows(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    """Over TCP with CURVE the table and the bytes come as two more frames; the trainer decodes into
    its own copy of the rows (received frames are read-only): the service's pixels, every sample."""
    keys = Keys(tmp_path / "keys")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = start_service(
        photos, endpoint=endpoint, batch_size=8, image_size=32, encoded_row_bytes=ROOM, **keys.flags()
    )
    remote = {"transport": "tcp", "timeout": 30, **keys.of(keys.trainer)}
    with ServiceLoader(service.endpoint, **remote) as reference:
        expected = epoch(reference, 2)
    with ServiceLoader(service.endpoint, decode="trainer", **remote) as loader:
        assert loader.transport == "tcp"
        got = epoch(loader, 2)
        decode = loader.stats()["decode"]
    assert got == expected
    assert decode["trainer_rows"] >= len(got) - WARM_BATCHES * 8 and decode["spoiled"] == 0, decode


def test_auto_moves_rows_to_a_trainer_whose_service_is_held_to_one_worker(
    photos: Path, start_service: ServiceFactory
) -> None:
    """One decode worker for a loop that only pulls: the loop waits on the service while the
    trainer's threads idle, so the split sends rows encoded; an epoch taken then is exact."""
    service = start_service(
        photos, batch_size=8, image_size=64, workers=1, encoded_row_bytes=ROOM, heartbeat_interval=0.25
    )
    with ServiceLoader(service.endpoint, timeout=30, decode="auto", decode_threads=2) as loader:
        deadline, number = time.monotonic() + 60, 0
        while loader.stats()["decode"]["trainer_rows"] < 8:
            assert time.monotonic() < deadline, f"the split did not move: {loader.stats()['decode']}"
            epoch(loader, number)
            number += 1
        before = loader.stats()["decode"]["trainer_rows"]
        got = epoch(loader, number)
        decode = loader.stats()["decode"]
    assert decode["moves"] > 0 and decode["share"] > 0 and decode["trainer_rows"] > before, decode
    with ServiceLoader(service.endpoint, timeout=30) as reference:
        assert epoch(reference, number) == got


def test_a_trainers_reports_of_bad_rows_are_bounded_by_the_rows_it_was_sent(
    photos: Path, start_service: ServiceFactory
) -> None:
    """A trainer is a peer: after its first batches, 300 claims of bad samples (over the protocol's
    256 a message, in three) count at most the rows announced to it (credits of 2: a few batches
    of 8), and a ``--strict`` service, which stops at the first bad file its own workers find,
    goes on."""
    service = start_service(photos, batch_size=8, image_size=32, workers=1, strict=True)
    with ServiceLoader(service.endpoint, timeout=30, credits=2) as loader:
        next(iter(loader))
        conn = loader._fleet.services[0].conn
        for first in range(0, 300, 100):
            conn.send(Spoiled(tuple((i, "made up") for i in range(first, first + 100))))
        wait_until(lambda: status(service.endpoint)["feeds"][0]["bad_files"] >= 8, "the claims arrived")
        body = status(service.endpoint)  # one snapshot: the count against the rows announced so far
        counted, announced = body["feeds"][0]["bad_files"], 8 * body["sessions"][0]["delivered"]
        assert 8 <= counted <= announced < 300, (counted, announced)
        assert len(epoch(loader, 1)) == 90, "the service goes on, --strict or not"
    assert service.proc.poll() is None


def test_a_local_loader_decodes_its_rows_too(photos: Path) -> None:
    """``ServiceLoader.local(..., decode="trainer")``: the private service offers encoded rows and the
    loader decodes them."""
    options = {"batch_size": 8, "image_size": 32, "workers": 1, "encoded_row_bytes": ROOM}
    with ServiceLoader.local(photos, decode="trainer", timeout=30, **options) as loader:
        got = epoch(loader, 1)
        decode = loader.stats()["decode"]
    assert len(got) == 90 and decode["trainer_rows"] > 0 and decode["spoiled"] == 0, decode


def jpeg_claiming(jpeg: bytes, height: int, width: int) -> bytes:
    """``jpeg`` with its frame header (SOF0) saying ``height x width``: a decompression bomb's shape."""
    sof = jpeg.index(b"\xff\xc0")
    body = bytearray(jpeg)
    body[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(body)


def test_bombs_and_other_formats_are_the_services_to_decode_or_refuse(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    """A JPEG that claims 60000 x 60000 pixels is refused by the service from its header and never
    sent; a PNG goes decoded. A trainer decoding the rest gets the same epoch as
    one the service decodes for, and has nothing to report."""
    data = tmp_path / "data"
    shutil.copytree(photos, data)
    jpegs = sorted(data.rglob("*.jpg"))
    bomb = jpegs[0]
    bomb.write_bytes(jpeg_claiming(bomb.read_bytes(), 60000, 60000))
    png = jpegs[1].with_suffix(".png")
    cv2.imwrite(str(png), cv2.imread(str(jpegs[1])))
    jpegs[1].unlink()
    service = start_service(data, batch_size=8, image_size=32, workers=1, encoded_row_bytes=ROOM)
    with ServiceLoader(service.endpoint, timeout=30, decode="trainer") as loader:
        got = epoch(loader, 1)
        decode = loader.stats()["decode"]
    with ServiceLoader(service.endpoint, timeout=30) as reference:
        assert epoch(reference, 1) == got
    assert len(got) == 89 and decode["spoiled"] == 0 and 0 < decode["trainer_rows"] <= 88, decode
    service.wait_for(rf"{re.escape(str(bomb.relative_to(data)))}: refused: more pixels")
    assert status(service.endpoint)["feeds"][0]["bad_files"] >= 1
