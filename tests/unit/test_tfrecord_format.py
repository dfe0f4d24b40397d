"""The tfrecord format: files the ``tfrecord`` package writes, read without TensorFlow, every record's
checksum checked (NOTE [ TFRecord framing ], NOTE [ Example features ])."""

from __future__ import annotations

import gzip
import os
import random
import struct
from pathlib import Path

import pytest

from loader_service.dataset.format import Columns
from loader_service.dataset.formats import detect_format
from loader_service.dataset.formats.tfrecord import crc, example
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import SampleReader
from loader_service.tools.sample_data import make_sample_dataset
from protocol.pixels import DecodeError
from testkit.fixtures import write_tfrecords

pytest.importorskip("tfrecord")
MAX = 1 << 28


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tfrsrc") / "data"
    make_sample_dataset(root, classes=3, per_class=6, seed=9)
    return root


def record_starts(path: Path) -> list[int]:
    """Where each record's header begins."""
    data, pos, starts = path.read_bytes(), 0, []
    while pos < len(data):
        starts.append(pos)
        pos += 12 + struct.unpack_from("<Q", data, pos)[0] + 4
    return starts


def test_records_are_the_image_folder_in_order_with_labels_less_the_offset(
    folder: Path, tmp_path: Path
) -> None:
    """TensorFlow's ImageNet layout: no suffix, labels 1..N keeping 0 for the background."""
    files = write_tfrecords(folder, tmp_path / "tfr", files=2, label_offset=1)
    assert detect_format(files) == detect_format(files / "train-00000-of-00002") == "tfrecord"
    assert detect_format(f"{files}/train-{{00000..00001}}-of-00002") == "tfrecord"
    plain = build_index(folder)
    index = build_index(files, columns=Columns(label_offset=1))
    assert index.kind == "tfrecord" and len(index) == len(plain) and not index.flaws
    assert list(index.labels) == list(plain.labels)
    assert list(build_index(files).labels) == [label + 1 for label in plain.labels], "no offset: as written"
    assert index.relpath(0) == "train-00000-of-00002:0" and index.relpath(len(index) - 1).startswith(
        "train-00001"
    )
    reader, expected = SampleReader(index, MAX), SampleReader(plain, MAX)
    assert all(reader.image_bytes(i) == expected.image_bytes(i) for i in range(len(plain)))
    (tmp_path / "index").mkdir()
    index.save(tmp_path / "index")
    loaded = DatasetIndex.load(tmp_path / "index")
    assert loaded.fingerprint() == index.fingerprint() != build_index(files).fingerprint()
    assert SampleReader(loaded, MAX).image_bytes(4) == expected.image_bytes(4)


def test_a_record_that_fails_its_checksum_costs_that_sample_named(folder: Path, tmp_path: Path) -> None:
    files = write_tfrecords(folder, tmp_path / "tfr", files=1)
    path = files / "train-00000-of-00001"
    starts = record_starts(path)
    data = bytearray(path.read_bytes())
    data[starts[3] + 400] ^= 0xFF  # inside record 3's image, at scan time
    path.write_bytes(bytes(data))
    index = build_index(files)
    assert index.flaws == {3: "its data fails its CRC-32C (the file is damaged)"}
    data[starts[5] + 400] ^= 0xFF  # record 5, after the scan: the worker's check
    path.write_bytes(bytes(data))
    reader = SampleReader(index, MAX)
    with pytest.raises(DecodeError, match=r"record train-00000-of-00001:5: CRC-32C mismatch"):
        reader.image_bytes(5)
    assert reader.image_bytes(6)


def test_broken_framing_keeps_the_records_before_it_and_skips_the_rest_of_that_file(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = write_tfrecords(folder, tmp_path / "tfr", files=2)
    first, second = sorted(files.iterdir())
    starts = record_starts(first)
    data = bytearray(first.read_bytes())
    data[starts[4] + 9] ^= 0xFF  # record 4's length checksum
    first.write_bytes(bytes(data))
    cut = second.read_bytes()
    second.write_bytes(cut[:-100])  # the last record runs past the end
    index = build_index(files)
    total = len(build_index(folder))
    per_file = -(-total // 2)
    assert len(index) == 4 + (total - per_file - 1)
    assert index.relpath(4) == "train-00001-of-00002:0"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"the length of record 4 at byte {starts[4]} fails its checksum" in logged
    assert "runs past the end" in logged


def test_compressed_files_and_records_that_are_no_example_are_named(folder: Path, tmp_path: Path) -> None:
    files = write_tfrecords(folder, tmp_path / "tfr", files=1)
    path = files / "train-00000-of-00001"
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "train-00000-of-00001").write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(DatasetError, match=r"train-00000-of-00001 is GZIP-compressed: decompress it first"):
        build_index(tmp_path / "gz")
    with pytest.raises(DatasetError, match="no records"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "x.tfrecord").write_bytes(b"")
        build_index(tmp_path / "empty")
    index = build_index(files, columns=Columns(image="image/png"))
    assert index.flaws[0].startswith("it has no bytes feature 'image/png' (features: image/class/label, ")


def test_crc32c_in_c_and_in_python_agree_with_the_standard_check_value() -> None:
    assert crc.crc32c(b"123456789") == crc.python_crc32c(b"123456789") == 0xE3069283
    data = os.urandom(10_000)
    assert crc.crc32c(data) == crc.python_crc32c(data)
    assert crc.crc32c(data[5000:], crc.crc32c(data[:5000])) == crc.crc32c(data), "continued"


def test_the_example_reader_takes_packed_and_unpacked_numbers_and_refuses_what_is_not_one() -> None:
    def field(number: int, wire: int, body: bytes) -> bytes:
        return bytes([number << 3 | wire]) + (bytes([len(body)]) + body if wire == 2 else body)

    unpacked = field(3, 2, field(1, 0, b"\x05") + field(1, 0, b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"))
    packed = field(3, 2, field(1, 2, b"\x07\x08"))
    entries = field(1, 2, field(1, 2, b"a") + field(2, 2, unpacked)) + field(
        1, 2, field(1, 2, b"b") + field(2, 2, packed)
    )
    found = example.features(field(1, 2, entries))
    assert found["a"] == example.Feature("int64", (5, -1)) and found["b"] == example.Feature("int64", (7, 8))
    rng = random.Random(1)
    for _ in range(2000):  # hostile bytes: a ValueError or features, nothing else
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        try:
            example.features(junk)
        except ValueError:
            pass
    with pytest.raises(ValueError, match="runs past its message"):
        example.features(b"\x0a\x7f\x00")
