"""The zip format: archives made by Python's ``zipfile``, indexed from the central directory and read
member by member (NOTE [ Zip directory ], NOTE [ Zip as an ImageFolder ], NOTE [ Zip member reads ])."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest

from loader_service.dataset.formats import FORMAT_CHOICES, detect_format
from loader_service.dataset.formats.zip import format as zip_format
from loader_service.dataset.formats.zip.central import _zip64_sizes
from loader_service.dataset.formats.zip.reader import ZipReader
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import SampleReader
from loader_service.tools.sample_data import make_sample_dataset
from protocol.pixels import DecodeError
from testkit.counting import CountingFiles
from testkit.fixtures import set_zip_field, write_zip, zip_data_offset

MAX = 1 << 28


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zipsrc") / "data"
    make_sample_dataset(root, classes=3, per_class=6, seed=11)
    return root


@pytest.mark.parametrize("top", ["", "train"])
def test_a_zip_is_the_image_folder_it_would_be_if_extracted(folder: Path, tmp_path: Path, top: str) -> None:
    """Shuffled entries, stored and deflated: the folder's order, labels, classes and bytes; read from
    inside a single top folder; named ``archive:member``."""
    archive = write_zip(folder, tmp_path / "train.zip", top=top)
    assert detect_format(archive) == "zip" and "zip" in FORMAT_CHOICES
    plain, zipped = build_index(folder), build_index(archive)
    assert zipped.kind == "zip" and zipped.classes == plain.classes
    assert list(zipped.labels) == list(plain.labels)
    prefix = f"train.zip:{top}/" if top else "train.zip:"
    assert [zipped.relpath(i) for i in range(len(zipped))] == [
        prefix + plain.relpath(i) for i in range(len(plain))
    ]
    with zipfile.ZipFile(archive) as z:
        methods = {info.compress_type for info in z.infolist() if not info.is_dir()}
    assert methods == {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED}
    reader, expected = SampleReader(zipped, MAX), SampleReader(plain, MAX)
    assert all(reader.image_bytes(i) == expected.image_bytes(i) for i in range(len(plain)))


def test_the_index_is_saved_and_read_back(folder: Path, tmp_path: Path) -> None:
    archive = write_zip(folder, tmp_path / "train.zip")
    built = build_index(archive)
    (tmp_path / "index").mkdir()
    built.save(tmp_path / "index")
    loaded = DatasetIndex.load(tmp_path / "index")
    assert loaded.fingerprint() == built.fingerprint()
    assert SampleReader(loaded, MAX).image_bytes(5) == SampleReader(built, MAX).image_bytes(5)


def test_a_member_costs_its_own_bytes_and_about_one_header(folder: Path, tmp_path: Path) -> None:
    """NOTE [ Zip member reads ]: one range a member: its data, its local header and the slack."""
    index = build_index(write_zip(folder, tmp_path / "train.zip"))
    files = CountingFiles(index.root)
    reader = ZipReader(files, index.names, zip_format._members(index), MAX)
    image = sum(len(reader.image_bytes(i)) for i in range(len(index)))
    assert files.bytes_read <= 1.05 * image, f"{files.bytes_read / image:.3f} bytes read per image byte"


def test_zip64_past_65535_entries(tmp_path: Path, folder: Path) -> None:
    """ImageNet's 1.28M members need ZIP64's end record: 70,000 entries (the 16-bit count says 0xFFFF)."""
    path = tmp_path / "many.zip"
    photo = next(folder.rglob("*.jpg")).read_bytes()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/0.jpg", photo)
        for k in range(70_000):
            z.writestr(f"b/{k:05d}.jpg", b"x")
    assert path.read_bytes()[-22:][10:12] == b"\xff\xff", "the plain end record cannot count them"
    index = build_index(path)
    assert len(index) == 70_001 and index.classes == ("a", "b")
    assert SampleReader(index, MAX).image_bytes(0) == photo
    assert index.relpath(70_000) == "many.zip:b/69999.jpg"


def test_zip64_extra_fields_give_the_sizes_and_offset_the_entry_defers() -> None:
    extra = struct.pack("<HHQQQ", 0x0001, 24, 5_000_000_000, 4_900_000_000, 7_000_000_000)
    other = struct.pack("<HH4s", 0x5455, 4, b"time")
    assert _zip64_sizes(other + extra, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) == (
        5_000_000_000, 4_900_000_000, 7_000_000_000,
    )  # fmt: skip
    only_offset = struct.pack("<HHQ", 0x0001, 8, 6_000_000_000)
    assert _zip64_sizes(only_offset, 10, 9, 0xFFFFFFFF) == (10, 9, 6_000_000_000)
    assert _zip64_sizes(b"", 10, 9, 0xFFFFFFFF) == (10, 9, -1), "missing: a flaw, never 4 GiB"


def test_a_damaged_member_is_a_bad_sample_named_and_the_rest_are_read(folder: Path, tmp_path: Path) -> None:
    path = write_zip(folder, tmp_path / "train.zip", order_seed=None)
    with zipfile.ZipFile(path) as z:
        stored = next(
            i.filename for i in z.infolist() if i.compress_type == zipfile.ZIP_STORED and not i.is_dir()
        )
    data = bytearray(path.read_bytes())
    data[zip_data_offset(path, stored) + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    index = build_index(path)
    reader = SampleReader(index, MAX)
    bad = next(i for i in range(len(index)) if index.relpath(i).endswith(stored))
    with pytest.raises(DecodeError, match=f"member {stored}: CRC-32 mismatch"):
        reader.image_bytes(bad)
    assert all(reader.image_bytes(i) for i in range(len(index)) if i != bad)


def test_encrypted_and_deflate64_members_are_flaws_named(folder: Path, tmp_path: Path) -> None:
    path = write_zip(folder, tmp_path / "train.zip", order_seed=None)
    set_zip_field(path, "class_000/img_00001.jpg", 8, "<H", 0x1)  # flags: encrypted
    set_zip_field(path, "class_001/img_00002.jpg", 10, "<H", 9)  # method: Deflate64
    index = build_index(path)
    flaws = {index.relpath(i): why for i, why in index.flaws.items()}
    assert flaws == {
        "train.zip:class_000/img_00001.jpg": "its member is encrypted: zip encryption is not supported",
        "train.zip:class_001/img_00002.jpg": (
            "its member is compressed with method 9 (Deflate64): only stored and deflated are read"
        ),
    }


def test_duplicate_names_refuse_the_archive_naming_one(folder: Path, tmp_path: Path) -> None:
    path = write_zip(folder, tmp_path / "train.zip")
    with pytest.warns(UserWarning), zipfile.ZipFile(path, "a") as z:
        z.writestr("class_002/img_00000.jpg", b"other bytes")
    with pytest.raises(DatasetError, match=r"2 entries named 'class_002/img_00000.jpg'"):
        build_index(path)


def test_sizes_are_bounded_before_and_while_a_member_is_read(folder: Path, tmp_path: Path) -> None:
    """A member over --max-file-bytes is refused unread; one that inflates past its stated size (a
    zip bomb's lie) or holds fewer bytes is a bad sample."""
    path = write_zip(folder, tmp_path / "train.zip", order_seed=None)
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if not i.is_dir()]
    deflated = next(i for i in infos if i.compress_type == zipfile.ZIP_DEFLATED)
    stored = next(i for i in infos if i.compress_type == zipfile.ZIP_STORED)
    index = build_index(path)
    at = {index.names.text(i): i for i in range(len(index))}
    with pytest.raises(DecodeError, match=r"over --max-file-bytes 1000"):
        SampleReader(index, 1000).image_bytes(at[deflated.filename])
    set_zip_field(path, deflated.filename, 24, "<I", deflated.file_size // 2)
    set_zip_field(path, stored.filename, 24, "<I", stored.file_size - 1)
    lied = build_index(path)
    reader = SampleReader(lied, MAX)
    with pytest.raises(DecodeError, match="inflates past its stated"):
        reader.image_bytes(at[deflated.filename])
    with pytest.raises(DecodeError, match=r"holds .* bytes, not its stated"):
        reader.image_bytes(at[stored.filename])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d[:-30], "no end of central directory record"),
        (lambda d: d[: len(d) // 2] + d[-22:], "runs past its end record"),
        (lambda d: b"not a zip at all" * 10, "is not a zip archive"),
    ],
)
def test_a_damaged_archive_is_refused_by_name(
    folder: Path, tmp_path: Path, make: object, message: str
) -> None:
    path = write_zip(folder, tmp_path / "train.zip")
    path.write_bytes(make(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(DatasetError, match=message):
        build_index(path)


def test_hidden_entries_and_resource_forks_are_no_samples_and_an_empty_class_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    path = write_zip(folder, tmp_path / "train.zip")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("__MACOSX/class_000/._img_00000.jpg", b"fork")
        z.writestr("class_000/.hidden.jpg", b"x")
        z.writestr(".git/config.jpg", b"x")
        z.writestr("top.jpg", b"x")
    assert len(build_index(path)) == len(build_index(folder))
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("notes/readme.txt", b"x")
    with pytest.raises(DatasetError, match=r"class folder 'notes' in zip archive .* holds no image files"):
        build_index(path)
