"""Formats users already have, served by a real service with damage in them: a damaged zip member and
an encrypted one, a TFRecord record that fails its checksum before the scan and one after it, each
cost its sample only, named in the log and counted; every other sample comes once an epoch (NOTE
[ Zip member reads ], NOTE [ TFRecord framing ])."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from testkit.fixtures import set_zip_field, write_tfrecords, write_zip, zip_data_offset
from tests.helpers import ServiceFactory, status

pytestmark = pytest.mark.integration


def test_a_damaged_and_an_encrypted_member_cost_their_samples_only(
    photos: Path, tmp_path: Path, start_service: ServiceFactory
) -> None:
    path = write_zip(photos, tmp_path / "train.zip", top="train")
    with zipfile.ZipFile(path) as z:
        members = [i for i in z.infolist() if not i.is_dir()]
    damaged = next(i.filename for i in members if i.compress_type == zipfile.ZIP_DEFLATED)
    locked = next(i.filename for i in members if i.filename != damaged)
    data = bytearray(path.read_bytes())
    data[zip_data_offset(path, damaged) + 50] ^= 0xFF
    path.write_bytes(bytes(data))
    set_zip_field(path, locked, 8, "<H", 0x1)
    index = build_index(path)
    bad = {i for i in range(len(index)) if index.names.text(i) in (damaged, locked)}
    assert len(bad) == 2
    service = start_service(path, batch_size=8, augment="none")
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        for _ in range(2):
            seen = [i for batch in loader for i in batch.indices.tolist()]
            assert sorted(seen) == sorted(set(range(len(index))) - bad), "every good member once, no bad one"
    service.wait_for(rf"train\.zip:{damaged}: .*(CRC-32 mismatch|does not inflate)")
    service.wait_for(rf"train\.zip:{locked}: .*encrypted")
    feed = status(service.endpoint)["feeds"][0]
    assert feed["format"] == "zip" and feed["bad_files"] >= 2
    assert service.stop() == 0


def test_tfrecord_records_that_fail_their_checksum_cost_their_samples_only(
    photos: Path, tmp_path: Path, start_service: ServiceFactory
) -> None:
    pytest.importorskip("tfrecord")
    files = write_tfrecords(photos, tmp_path / "tfr", files=2)
    path = files / "train-00000-of-00002"
    data, pos, starts = bytearray(path.read_bytes()), 0, []
    while pos < len(data):
        starts.append(pos)
        pos += 12 + struct.unpack_from("<Q", data, pos)[0] + 4
    data[starts[3] + 500] ^= 0xFF  # found by the scan: a flaw
    path.write_bytes(bytes(data))
    n = len(build_index(files))
    service = start_service(files, batch_size=8, augment="none")
    data[starts[7] + 500] ^= 0xFF  # after the scan: found by the worker that reads it
    path.write_bytes(bytes(data))
    good = set(range(n)) - {3}
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        # The warm start may have decoded record 7 before it was damaged: epoch 0 may hold it.
        first = [i for batch in loader for i in batch.indices.tolist()]
        assert sorted(first) in (sorted(good), sorted(good - {7})), "every good record once"
        second = [i for batch in loader for i in batch.indices.tolist()]
        assert sorted(second) == sorted(good - {7}), "no damaged record delivered"
    service.wait_for(r"train-00000-of-00002:3: its data fails its CRC-32C")
    service.wait_for(r"train-00000-of-00002:7: .*CRC-32C mismatch")
    assert status(service.endpoint)["feeds"][0]["format"] == "tfrecord"
    assert service.stop() == 0
