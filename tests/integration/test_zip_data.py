"""A zip archive served by a real service: a damaged member and an encrypted one cost their samples
only, named by archive and member in the log and counted; every other sample comes once an epoch
(NOTE [ Zip member reads ], NOTE [ Zip as an ImageFolder ])."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from gpu_worker import ServiceLoader
from loader_service.dataset.index import build_index
from testkit.fixtures import set_zip_field, write_zip, zip_data_offset
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
