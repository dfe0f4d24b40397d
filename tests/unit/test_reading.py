"""SampleReader: a sample's image bytes and metadata, from a file or in place from a tar shard."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.storage import local as storage
from loader_service.decode.reading import SampleReader
from protocol.pixels import DecodeError
from tests.helpers import write_tar

MAX_BYTES = 1 << 20
ReaderFactory = Callable[..., SampleReader]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def reader_of() -> Iterator[ReaderFactory]:
    readers: list[SampleReader] = []

    def make(index: DatasetIndex, max_bytes: int = MAX_BYTES) -> SampleReader:
        readers.append(SampleReader(index, max_bytes))
        return readers[-1]

    yield make
    for r in readers:
        r.close()


def test_files_of_an_image_folder_and_a_list(tmp_path: Path, reader_of: ReaderFactory) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(b"jpeg bytes")
    (tmp_path / "l.csv").write_text("path,label,caption\ncat/a.jpg,1,a cat\nmissing.jpg,2,gone\n")
    (tmp_path / "l.jsonl").write_text('{"path": "cat/a.jpg", "box": [1, 2], "n": null}\n')
    folder = reader_of(build_index(tmp_path, "imagefolder"))
    assert folder.image_bytes(0) == b"jpeg bytes"
    assert folder.metadata(0) == {}
    listed = reader_of(build_index(tmp_path / "l.csv"))
    assert listed.image_bytes(0) == b"jpeg bytes"
    assert {k: v() for k, v in listed.metadata(0).items()} == {"caption": "a cat"}
    with pytest.raises(DecodeError, match="cannot read: No such file"):
        listed.image_bytes(1)
    jsonl = reader_of(build_index(tmp_path / "l.jsonl"))
    assert {k: v() for k, v in jsonl.metadata(0).items()} == {"box": [1, 2], "n": None}


def test_files_get_read_files_checks(tmp_path: Path, reader_of: ReaderFactory) -> None:
    (tmp_path / "big.jpg").write_bytes(bytes(100))
    os.mkfifo(tmp_path / "fifo.jpg")
    (tmp_path / "l.csv").write_text("path\nbig.jpg\nfifo.jpg\n")
    reader = reader_of(build_index(tmp_path / "l.csv"), max_bytes=99)
    with pytest.raises(DecodeError, match="file of 100 bytes is over --max-file-bytes 99"):
        reader.image_bytes(0)
    with pytest.raises(DecodeError, match="not a regular file: a FIFO"):
        reader.image_bytes(1)


def test_tar_members_read_in_place(tmp_path: Path, reader_of: ReaderFactory) -> None:
    long_key = "x" * 120 + "/ü"  # a pax path record
    members = [
        (f"{long_key}.jpg", b"first image"),
        (f"{long_key}.cls", b"3"),
        (f"{long_key}.json", b'{"a": 1}'),
        (f"{long_key}.png", b"a second image is metadata"),
        ("k.webp", os.urandom(5000)),
        ("k.txt", b"caption"),
    ]
    shard = write_tar(tmp_path / "s.tar", members)
    index = build_index(shard)
    reader = reader_of(index)
    assert reader.image_bytes(0) == b"first image"
    assert {k: v() for k, v in reader.metadata(0).items()} == {
        "cls": b"3",
        "json": b'{"a": 1}',
        "png": b"a second image is metadata",
    }
    assert reader.image_bytes(1) == members[4][1]
    assert {k: v() for k, v in reader.metadata(1).items()} == {"txt": b"caption"}
    saved = tmp_path / "saved"
    saved.mkdir()
    index.save(saved)
    assert reader_of(DatasetIndex.load(saved)).image_bytes(1) == members[4][1]


def test_bad_tar_samples_are_decode_errors(tmp_path: Path, reader_of: ReaderFactory) -> None:
    members = [
        ("none.cls", b"1"),
        ("none.txt", b"no image member"),
        ("big.jpg", bytes(2000)),
        ("empty.jpg", b""),
        ("flawed.jpg", b"x"),
        ("flawed.cls", b"not a number"),
        ("cut.jpg", b"whole"),
        ("cut.json", bytes(1500)),
    ]
    shard = write_tar(tmp_path / "s.tar", members)
    with tarfile.open(shard) as tar:
        cut = tar.getmember("cut.json").offset_data + 1000
    shard.write_bytes(shard.read_bytes()[:cut])
    reader = reader_of(build_index(shard), max_bytes=1999)
    with pytest.raises(
        DecodeError, match=r"no image member \(jpg, jpeg, png, webp, bmp; members: cls, txt\)"
    ):
        reader.image_bytes(0)
    with pytest.raises(DecodeError, match=r"member big\.jpg of 2000 bytes is over --max-file-bytes 1999"):
        reader.image_bytes(1)
    with pytest.raises(DecodeError, match=r"member empty\.jpg is empty"):
        reader.image_bytes(2)
    for read in (reader.image_bytes, reader.metadata):
        with pytest.raises(DecodeError, match=r"label member flawed\.cls is not an integer"):
            read(3)
    assert reader.image_bytes(4) == b"whole"
    json_member = reader.metadata(4)["json"]  # read only when called
    with pytest.raises(
        DecodeError, match=r"member cut\.json runs past the end of shard s\.tar \(1000 of 1500 bytes\)"
    ):
        json_member()


def test_empty_metadata_members_are_empty_bytes(tmp_path: Path, reader_of: ReaderFactory) -> None:
    members = [
        ("a.jpg", b"image"),
        ("a.txt", b""),  # an empty caption
        ("a.json", b"{}"),
        ("a.png", b""),  # a second image member is metadata
        ("b.jpg", b""),
        ("b.txt", b""),
    ]
    reader = reader_of(build_index(write_tar(tmp_path / "s.tar", members)))
    assert reader.image_bytes(0) == b"image"
    assert {k: v() for k, v in reader.metadata(0).items()} == {"txt": b"", "json": b"{}", "png": b""}
    with pytest.raises(DecodeError, match=r"member b\.jpg is empty"):
        reader.image_bytes(1)
    assert {k: v() for k, v in reader.metadata(1).items()} == {"txt": b""}


def test_a_shard_replaced_by_a_fifo_is_refused_without_blocking(
    tmp_path: Path, reader_of: ReaderFactory
) -> None:
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", b"x")])
    index = build_index(shard)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(DecodeError, match=r"shard .*s\.tar is not a regular file"):
        reader_of(index).image_bytes(0)
    shard.unlink()
    with pytest.raises(DecodeError, match=r"cannot open shard .*No such file"):
        reader_of(index).image_bytes(0)


def test_open_shards_are_bounded_and_closed(
    tmp_path: Path, reader_of: ReaderFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "OPEN_FILES", 3)
    for s in range(6):
        write_tar(tmp_path / f"{s}.tar", [(f"k{s}.jpg", f"image {s}".encode())])
    reader = reader_of(build_index(tmp_path))
    before = open_fds()
    for _ in range(2):
        assert [reader.image_bytes(i) for i in range(6)] == [f"image {s}".encode() for s in range(6)]
        assert open_fds() == before + 3
    reader.close()
    assert open_fds() == before
    assert reader.image_bytes(5) == b"image 5"  # a closed reader opens shards again
