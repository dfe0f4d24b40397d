"""List (csv, jsonl) and tar (WebDataset-style) sources: what they index, and every error they name."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pytest

from loader_service.dataset.formats.tar import fast as tarfast
from loader_service.dataset.formats.tar import headers as tarformat
from loader_service.dataset.formats.tar.headers import (
    BadHeader,
    number,
    octal,
    octal_fields_ok,
    overridden,
    pax_records,
)
from loader_service.dataset.formats.tar.samples import SampleTable
from loader_service.dataset.formats.tar.scan import scan_shards
from loader_service.dataset.formats.tar.shards import list_shards
from loader_service.dataset.index import DatasetError, DatasetIndex, build_index
from loader_service.dataset.storage.patterns import expand_braces
from loader_service.dataset.tables import ListMetadata, TarMembers
from tests.helpers import write_tar

REPO = Path(__file__).resolve().parents[2]
Member = tuple[str, bytes]


def samples(keys: Iterable[str], label: bool = True) -> list[Member]:
    """Each key as ``KEY.jpg`` (its bytes name it) and, with ``label``, ``KEY.cls`` (its number)."""
    out = []
    for n, key in enumerate(keys):
        out.append((f"{key}.jpg", f"image {key}".encode()))
        if label:
            out.append((f"{key}.cls", f"{n}\n".encode()))
    return out


def webdataset_reference(shards: Sequence[Path]) -> list[tuple[str, dict[str, bytes]]]:
    """WebDataset's grouping (``tariterators.group_by_keys`` over ``base_plus_ext``), restated over
    Python's tarfile, plus the one rule of ours (hidden files are skipped): ``(shard:key, {extension:
    data})`` per sample."""
    out: list[tuple[str, dict[str, bytes]]] = []
    for shard in shards:
        current: tuple[str, dict[str, bytes]] | None = None
        with tarfile.open(shard) as tar:
            for info in tar:
                match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", info.name)
                hidden = info.name.rpartition("/")[2].startswith(".")  # skipped, as ImageFolder does
                if not info.isreg() or not match or hidden or re.match(r"__[^/]*__($|/)", info.name):
                    continue
                key, ext = match.group(1), match.group(2).lower()
                if current is None or current[0] != f"{shard.name}:{key}":
                    current = (f"{shard.name}:{key}", {})
                    out.append(current)
                data = tar.extractfile(info)
                assert data is not None
                current[1][ext] = data.read()
    return out


def members_of(index: DatasetIndex, i: int) -> dict[str, tuple[int, int]]:
    tar = index.part
    assert isinstance(tar, TarMembers)
    return {tar.extension(m): (int(tar.member_offset[m]), int(tar.member_size[m])) for m in tar.members(i)}


def index_data(index: DatasetIndex, i: int) -> dict[str, bytes]:
    out = {}
    for ext, (offset, size) in members_of(index, i).items():
        with open(index.path(i), "rb") as f:
            f.seek(offset)
            out[ext] = f.read(size)
    return out


def assert_same_scans(root: Path, shards: Sequence[str]) -> None:
    fast, careful = scan_shards(root, shards), scan_shards(root, shards, fast=False)
    assert np.array_equal(fast.labels, careful.labels)
    assert fast.keys.blob.tobytes() == careful.keys.blob.tobytes()
    assert np.array_equal(fast.keys.offsets, careful.keys.offsets)
    assert fast.members.extensions == careful.members.extensions
    for name, arr in fast.members.arrays.items():
        assert np.array_equal(arr, careful.members.arrays[name]), name
    assert fast.flaws == careful.flaws


# --- csv -------------------------------------------------------------------------------------------


def test_csv_rows_in_order_with_labels_metadata_and_paths_from_the_list_folder(tmp_path: Path) -> None:
    (tmp_path / "lists").mkdir()
    listed = tmp_path / "lists" / "train.csv"
    listed.write_text(
        "\ufeffpath,label,caption,source\n"  # a spreadsheet's byte-order mark
        'img/a.jpg,3,"a cat, sitting",web\n'
        "\n"
        f"{tmp_path}/abs.png,,two\nlines,scan\n".replace("two\nlines", '"two\nlines"')
        + "img/ü.jpg,-1,,\n",
        encoding="utf-8",
    )
    index = build_index(listed)
    assert (index.kind, index.classes, len(index)) == ("list", (), 3)
    assert index.labels.tolist() == [3, -1, -1]
    assert [index.relpath(i) for i in range(3)] == ["img/a.jpg", f"{tmp_path}/abs.png", "img/ü.jpg"]
    assert index.path(0) == tmp_path / "lists" / "img" / "a.jpg"
    assert index.path(1) == tmp_path / "abs.png"
    assert isinstance(index.part, ListMetadata)
    assert index.part.items(0) == {"caption": "a cat, sitting", "source": "web"}
    assert index.part.items(1) == {"caption": "two\nlines", "source": "scan"}
    assert index.num_classes == 4


def test_a_csv_without_metadata_columns_keeps_no_metadata(tmp_path: Path) -> None:
    listed = tmp_path / "l.csv"
    listed.write_text("label,path\n1,a.jpg\n0,b.jpg\n")
    index = build_index(listed)
    assert index.part is None
    assert index.labels.tolist() == [1, 0]
    assert index.nbytes == index.labels.nbytes + index.names.nbytes


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", r"l\.csv is empty"),
        ("file,label\na.jpg,1\n", r"l\.csv:1: the header has no 'path' column"),
        ("path,label,path\na,1,b\n", r"l\.csv:1: column 'path' appears twice"),
        ("path,,x\na,1,b\n", r"l\.csv:1: column 2 of the header has no name"),
        ("path,label\na.jpg,1\n,2\n", r"l\.csv:3: the path is empty"),
        ("path,label\na.jpg,1\n\nb.jpg,3.5\n", r"l\.csv:4: label '3\.5' is not an integer"),
        ("path,label\na.jpg,cat\n", r"l\.csv:2: label 'cat' is not an integer"),
        ("path,label\na.jpg,1_000\n", r"l\.csv:2: label '1_000' is not an integer"),
        ("path,label\na.jpg,99999999999999999999\n", r"l\.csv:2: label 99999999999999999999 does not fit"),
        ("path,label\na.jpg,1,extra\n", r"l\.csv:2: 3 cells, the header has 2"),
        ("path,label\n", r"l\.csv lists no samples"),
    ],
)
def test_csv_errors_name_the_line(tmp_path: Path, text: str, error: str) -> None:
    listed = tmp_path / "l.csv"
    listed.write_text(text)
    with pytest.raises(DatasetError, match=error):
        build_index(listed)


# --- jsonl -----------------------------------------------------------------------------------------


def test_jsonl_rows_with_json_metadata(tmp_path: Path) -> None:
    listed = tmp_path / "train.jsonl"
    rows = [
        {"path": "a.jpg", "label": 2, "boxes": [[1, 2, 3, 4]], "meta": {"w": 3}},
        {"path": "b.jpg", "label": None},
        {"path": "c.jpg"},
    ]
    listed.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    index = build_index(listed)
    assert index.labels.tolist() == [2, -1, -1]
    assert [index.relpath(i) for i in range(3)] == ["a.jpg", "b.jpg", "c.jpg"]
    assert isinstance(index.part, ListMetadata)
    assert index.part.items(0) == {"boxes": [[1, 2, 3, 4]], "meta": {"w": 3}}
    assert index.part.items(1) == {}


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (['{"path": "a.jpg"}', "", '{"path": "b.jpg",}'], r"l\.jsonl:3: not valid JSON"),
        (['["a.jpg", 1]'], r"l\.jsonl:1: expected a JSON object, got list"),
        (['{"label": 1}'], r"l\.jsonl:1: 'path' must be a string, got nothing"),
        (['{"path": 7}'], r"l\.jsonl:1: 'path' must be a string, got int"),
        (['{"path": " "}'], r"l\.jsonl:1: the path is empty"),
        (['{"path": "a", "label": true}'], r"l\.jsonl:1: label must be an integer or null, got bool"),
        (['{"path": "a", "label": "3"}'], r"l\.jsonl:1: label must be an integer or null, got str"),
        (['{"path": "a", "label": 1.0}'], r"l\.jsonl:1: label must be an integer or null, got float"),
        (['{"path": "\\ud800"}'], r"l\.jsonl:1: the path is not utf-8"),
        (
            ['{"path": "a", "m": ' + "[" * 100_000 + "]" * 100_000 + "}"],
            r"l\.jsonl:1: JSON nested too deeply",
        ),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, lines: list[str], error: str) -> None:
    listed = tmp_path / "l.jsonl"
    listed.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=error):
        build_index(listed)


def test_a_list_of_another_suffix_is_read_by_its_first_character(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text('{"path": "x.jpg", "label": 1}\n')
    (tmp_path / "b.txt").write_text("path,label\nx.jpg,1\n")
    assert build_index(tmp_path / "a.txt", "list").labels.tolist() == [1]
    assert build_index(tmp_path / "b.txt", "list").labels.tolist() == [1]
    with pytest.raises(DatasetError, match="cannot tell the format"):
        build_index(tmp_path / "a.txt")


def test_progress_every_10000_samples(tmp_path: Path) -> None:
    listed = tmp_path / "big.csv"
    listed.write_text("path\n" + "".join(f"{i}.jpg\n" for i in range(25_000)))
    calls: list[int] = []
    assert len(build_index(listed, progress=calls.append)) == 25_000
    assert calls == [10_000, 20_000]


# --- tar: what is a sample ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_samples_group_as_webdataset_does(tmp_path: Path, fmt: int) -> None:
    long_dir = "d" * 90 + "/" + "e" * 60  # over 100 bytes: a ustar prefix, a GNU L or a pax path
    members = [
        ("000.jpg", b"j0"),
        ("000.cls", b" 7\n"),
        ("000.seg.png", b"mask"),  # extension "seg.png", not an image
        ("000.JSON", b'{"a": 1}'),  # extensions are lower-cased
        ("folder/", b""),  # not regular once tarfile sees the slash... a file named so: skipped
        ("README", b"no dot: no key"),
        (".hidden.jpg", b"no key"),
        ("__key__", b"webdataset metadata"),
        (f"{long_dir}/001.jpg", b"j1"),
        (f"{long_dir}/001.txt", b"caption"),
        ("002.png", b"j2"),
        ("sp .jpg", b"a key with a space"),
        ("sp.jpg", b"another key"),
        ("000.jpg", b"a key again, not consecutive: a new sample"),
    ]
    if fmt == tarfile.PAX_FORMAT:
        members.append(("ünï.jpg", b"pax path record"))
    shard = write_tar(tmp_path / "train-0.tar", members, fmt)
    index = build_index(shard)
    reference = webdataset_reference([shard])
    assert [index.relpath(i) for i in range(len(index))] == [name for name, _ in reference]
    assert [index_data(index, i) for i in range(len(index))] == [data for _, data in reference]
    assert index.labels.tolist()[:4] == [7, -1, -1, -1]
    assert index.flaws == {}
    assert_same_scans(tmp_path, ["train-0.tar"])


def test_directories_links_and_samples_never_span_shards(tmp_path: Path) -> None:
    first = tmp_path / "a.tar"
    with tarfile.open(first, "w") as tar:
        folder = tarfile.TarInfo("imgs")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in samples(["imgs/k"]):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("imgs/k.png")
        link.type = tarfile.SYMTYPE
        link.linkname = "k.jpg"
        tar.addfile(link)
    write_tar(tmp_path / "b.tar", [("imgs/k.txt", b"same key, next shard")])
    index = build_index(tmp_path)
    assert [index.relpath(i) for i in range(len(index))] == ["a.tar:imgs/k", "b.tar:imgs/k"]
    assert list(members_of(index, 0)) == ["jpg", "cls"]
    assert index.path(1) == tmp_path / "b.tar"
    assert_same_scans(tmp_path, ["a.tar", "b.tar"])


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 8192])
def test_the_fast_scan_matches_the_careful_one_across_batch_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    rng = random.Random(batch)
    for s in range(3):
        members: list[Member] = []
        for k in range(40):
            key = f"s{s}/{k:04d}" if rng.random() < 0.5 else f"{k:04d}"
            for ext in rng.sample(["jpg", "cls", "json", "txt", "PNG", "a.b"], rng.randint(1, 4)):
                data = str(k).encode() if ext == "cls" else bytes(rng.randint(0, 1500))
                if ext == "cls" and rng.random() < 0.1:
                    data = b"not a number"
                members.append((f"{key}.{ext}", data))
            if rng.random() < 0.1:
                members.append(members[-1])  # an extension twice: a flaw
        write_tar(tmp_path / f"{s}.tar", members, tarfile.GNU_FORMAT)
    monkeypatch.setattr(tarfast, "BATCH", batch)
    assert_same_scans(tmp_path, ["0.tar", "1.tar", "2.tar"])


def test_labels_flaws_from_bad_or_repeated_members(tmp_path: Path) -> None:
    members = [
        *samples(["a"]),
        ("b.jpg", b"x"),
        ("b.cls", b"cat"),
        ("c.jpg", b"x"),
        ("c.cls", b"1" * 100),
        ("d.jpg", b"x"),
        ("d.jpg", b"again"),
        ("e.cls", b"5"),  # no image: indexed, bad when read (test_reading)
        ("f.jpg", b"x"),
        ("f.cls", b"99999999999999999999"),
    ]
    shard = write_tar(tmp_path / "s.tar", members, tarfile.GNU_FORMAT)
    index = build_index(shard)
    assert [index.relpath(i) for i in range(len(index))] == [f"s.tar:{k}" for k in "abcdef"]
    assert index.labels.tolist() == [0, -1, -1, -1, 5, -1]
    assert index.flaws == {
        1: "label member b.cls is not an integer: b'cat'",
        2: "label member c.cls has 100 bytes; expected a number",
        3: "two members d.jpg",
        5: "label member f.cls is not an integer: b'99999999999999999999'",
    }
    assert_same_scans(tmp_path, ["s.tar"])


def test_progress_every_10000_tar_samples(tmp_path: Path) -> None:
    write_tar(tmp_path / "0.tar", [(f"{k:05d}.cls", b"1") for k in range(15_000)], tarfile.GNU_FORMAT)
    write_tar(tmp_path / "1.tar", [(f"{k:05d}.cls", b"1") for k in range(10_000)], tarfile.GNU_FORMAT)
    calls: list[int] = []
    assert len(build_index(tmp_path, progress=calls.append)) == 25_000
    assert calls == [10_000, 20_000]


# --- tar: damage -------------------------------------------------------------------------------------


def header_offsets(shard: Path) -> dict[str, int]:
    with tarfile.open(shard) as tar:
        return {info.name: info.offset for info in tar}


def test_a_damaged_header_costs_the_samples_around_it_not_the_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(f"{k:03d}" for k in range(10)), tarfile.GNU_FORMAT)
    at = header_offsets(shard)["004.cls"]
    with open(shard, "r+b") as f:
        f.seek(at + 10)
        f.write(b"garbage")
    with caplog.at_level(logging.WARNING):
        index = build_index(shard)
    assert f"shard s.tar: damaged tar header at offset {at}; resumed at offset {at + 1024}" in caplog.text
    assert len(index) == 10
    reason = f"tar header damaged at offset {at} of s.tar"
    assert index.flaws == {4: reason, 5: reason}  # 004 lost its label; 005 follows the damage
    assert index.labels.tolist() == [0, 1, 2, 3, -1, 5, 6, 7, 8, 9]
    assert list(members_of(index, 4)) == ["jpg"]


def test_a_zeroed_header_inside_a_shard_is_read_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(["a", "b", "c"]), tarfile.GNU_FORMAT)
    at = header_offsets(shard)["b.jpg"]
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(bytes(512))
    with caplog.at_level(logging.WARNING):
        index = build_index(shard)
    assert f"zero blocks at offset {at}: damaged? read on at offset {at + 1024}" in caplog.text
    assert [index.relpath(i) for i in range(len(index))] == ["s.tar:a", "s.tar:b", "s.tar:c"]
    assert set(index.flaws) == {0, 1}
    assert list(members_of(index, 1)) == ["cls"]


def test_concatenated_archives_are_read_through(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    one = write_tar(tmp_path / "1.tar", samples(["a"]))
    two = write_tar(tmp_path / "2.tar", samples(["b"]))
    (tmp_path / "both.tar").write_bytes(one.read_bytes() + two.read_bytes())
    with caplog.at_level(logging.WARNING):
        index = build_index(tmp_path / "both.tar")
    assert [index.relpath(i) for i in range(len(index))] == ["both.tar:a", "both.tar:b"]
    assert index.labels.tolist() == [0, 0]
    assert index.flaws == {}
    assert "another archive follows the end of one" in caplog.text


def test_a_member_past_the_end_is_indexed_and_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = write_tar(tmp_path / "s.tar", [*samples(["a"]), ("b.jpg", bytes(5000))])
    cut = header_offsets(shard)["b.jpg"] + 512 + 1000
    shard.write_bytes(shard.read_bytes()[:cut])
    with caplog.at_level(logging.WARNING):
        index = build_index(shard)
    assert "member b.jpg at offset" in caplog.text and "runs past the end of the shard" in caplog.text
    assert [index.relpath(i) for i in range(len(index))] == ["s.tar:a", "s.tar:b"]
    assert members_of(index, 1)["jpg"][1] == 5000


def set_size_field(shard: Path, at: int, field: bytes) -> None:
    """Write ``field`` into the size field of the header at ``at``, and a right checksum."""
    data = bytearray(shard.read_bytes())
    data[at + 124 : at + 136] = field.ljust(12, b"\0")
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
    shard.write_bytes(bytes(data))


def fast_scan_refuses(shard: Path) -> bool:
    """Whether the fast scan takes the shard (False) or steps aside with NotPlain (True)."""
    fd = os.open(shard, os.O_RDONLY)
    try:
        tarfast.scan_plain(fd, os.fstat(fd).st_size, 0, SampleTable(None))
    except tarfast.NotPlain:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (b"00000001750\0", 0o1750),
        (b"00000001750 ", 0o1750),  # a space instead of the NUL
        (b"      1750 \0", 0o1750),  # old tars: leading spaces
        (b"0001750\0garbage", 0o1750),  # what follows the NUL is not read
        (b"\0" * 12, 0),
        (b"\x80" + (5).to_bytes(11, "big"), 5),  # GNU base-256
    ],
)
def test_tar_number_fields(field: bytes, value: int) -> None:
    assert number(field) == value


@pytest.mark.parametrize(
    "field",
    [
        b"-0000001000\0",
        b"+0000000007\0",
        b"0000000_007\0",
        b"\t0000000007\0",
        b"0000000007\n\0",
        b"0o000000007\0",
        b"00000 00007\0",
        b"           \0",
        b"\xff" + bytes(11),  # GNU base-256, negative
        b"\xc0" + bytes(10) + b"\x07",  # GNU base-256: the sign bit is 0x40
    ],
)
def test_tar_number_fields_that_are_not_octal(field: bytes) -> None:
    with pytest.raises(BadHeader):
        number(field)


def test_the_fast_scans_field_check_agrees_with_the_careful_one() -> None:
    rng = random.Random(0)
    alphabet = b"0000001777 \0\0-+_\t8o\x80\xb0\xff"
    fields = [bytes(rng.choices(alphabet, k=rng.randint(0, 8))).ljust(8, b"\0") for _ in range(20_000)]
    fields += [b"%06o\0 " % rng.randrange(8**6) for _ in range(100)] + [b" " * 8, b" 17 \0-+ ", b"7" * 8]
    for width in (8, 7, 3):  # the checksum field, and shorter ones
        cut = [f[:width] for f in fields]
        rows = np.frombuffer(b"".join(cut), np.uint8).reshape(-1, width)
        ok = octal_fields_ok(rows)
        assert ok.tolist() == [octal(f) is not None for f in cut]
        assert 1000 < ok.sum() < len(fields) - 1000
        values = tarformat._octal_fields(rows)  # what checksums_ok compares the sums with
        read = ok & (rows[:, 0] != 0)
        assert values[read].tolist() == [octal(f) for f, good in zip(cut, read, strict=True) if good]


@pytest.mark.parametrize("text", [b"15 size=-100\n", b"15 size=+100\n", b"15 size=1_00\n", b"15 size= 100\n"])
def test_a_pax_size_that_is_not_decimal(text: bytes) -> None:
    records = pax_records(text)
    with pytest.raises(BadHeader):
        overridden(b"a.jpg", 7, True, None, records)


@pytest.mark.parametrize(
    "text", [b"-1 a=b\n", b"+11 path=x\n", b"0_12 path=x\n", b"\t11 path=x\n", b" 11 path=x\n"]
)
def test_a_pax_record_length_that_is_not_decimal(text: bytes) -> None:
    with pytest.raises(BadHeader):
        pax_records(text)


HOSTILE_SIZES = [
    b"-0000001000\0",  # negative: moved the scan backwards, then OverflowError
    b"-0000000001\0",
    b"+0000000002\0",
    b"0000000_002\0",  # "1_7": Python's int reads it
    b" \t000000002\0",
    b"00000000002\n",
]


def index_with_one_damaged_header(shard: Path, at: int, caplog: pytest.LogCaptureFixture) -> DatasetIndex:
    """Index ``shard`` (s.tar, samples 000-009) whose header at ``at``, sample 004's ``.cls``, is
    damage: logged, resumed after, samples 004 and 005 flawed and 004 unlabelled, no sample lost."""
    with caplog.at_level(logging.WARNING):
        index = build_index(shard)
    assert f"shard s.tar: damaged tar header at offset {at}; resumed at offset {at + 1024}" in caplog.text
    assert [index.relpath(i) for i in range(len(index))] == [f"s.tar:{k:03d}" for k in range(10)]
    reason = f"tar header damaged at offset {at} of s.tar"
    assert index.flaws == {4: reason, 5: reason}
    assert index.labels.tolist() == [0, 1, 2, 3, -1, 5, 6, 7, 8, 9]
    return index


@pytest.mark.parametrize("field", HOSTILE_SIZES)
@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_a_size_field_that_is_not_octal_is_damage_in_both_scans(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: bytes, fmt: int
) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(f"{k:03d}" for k in range(10)), fmt)
    at = header_offsets(shard)["004.cls"]  # the label "4\n": 2 bytes
    set_size_field(shard, at, field)
    assert fast_scan_refuses(shard)
    index = index_with_one_damaged_header(shard, at, caplog)
    assert [index_data(index, i) for i in range(10)] == [
        {"jpg": f"image {k:03d}".encode()}
        if k == 4
        else {"jpg": f"image {k:03d}".encode(), "cls": b"%d\n" % k}
        for k in range(10)
    ]
    assert_same_scans(tmp_path, ["s.tar"])


@pytest.mark.parametrize("size", ["-1000", "-2", "+2", "0_2", " 2", "2 ", "0x2", "", "99999999999"])
def test_a_pax_size_that_is_not_decimal_or_runs_past_the_end_is_damage_in_both_scans(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, size: str
) -> None:
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in samples(f"{k:03d}" for k in range(10)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if name == "004.cls":
                info.pax_headers = {"size": size}  # the ustar field holds 0
                at = tar.offset + 1024  # after the pax header and its records
            tar.addfile(info, io.BytesIO(data))
    assert fast_scan_refuses(shard)
    index_with_one_damaged_header(shard, at, caplog)
    assert_same_scans(tmp_path, ["s.tar"])


@pytest.mark.parametrize("field", [b"00000000007 ", b"      7 \0\0\0\0", b"00000000007\0"])
def test_size_fields_as_tars_pad_them_take_the_fast_scan(tmp_path: Path, field: bytes) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(["a", "b"]), tarfile.GNU_FORMAT)
    set_size_field(shard, header_offsets(shard)["b.jpg"], field)  # "image b": 7 bytes
    assert not fast_scan_refuses(shard)
    index = build_index(shard)
    assert index_data(index, 1) == {"jpg": b"image b", "cls": b"1\n"}
    assert index.flaws == {}
    assert_same_scans(tmp_path, ["s.tar"])


def test_a_checksum_field_that_is_not_octal_is_damage(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(["a", "b", "c"]), tarfile.GNU_FORMAT)
    at = header_offsets(shard)["b.jpg"]
    data = bytearray(shard.read_bytes())
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"+%06o\0" % sum(data[at : at + 512])  # the right sum, with a sign
    shard.write_bytes(bytes(data))
    assert fast_scan_refuses(shard)
    index = build_index(shard)
    assert set(index.flaws) == {0, 1}
    assert list(members_of(index, 1)) == ["cls"]
    assert_same_scans(tmp_path, ["s.tar"])


def test_the_fast_scan_steps_aside_without_numpy_strings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tarfast.has_numpy_strings(np)  # numpy 2.3 or later here
    assert not tarfast.has_numpy_strings(object())  # numpy before 2.0
    assert not tarfast.has_numpy_strings(type("Numpy22", (), {"strings": type("S", (), {})})())
    for s in range(2):
        members = [*samples([f"{s}/{k:03d}" for k in range(30)]), ("x.jpg", b"1"), ("x.jpg", b"2")]
        write_tar(tmp_path / f"{s}.tar", members, tarfile.GNU_FORMAT)
    assert not fast_scan_refuses(tmp_path / "0.tar")
    fast = scan_shards(tmp_path, ["0.tar", "1.tar"])
    monkeypatch.setattr(tarfast, "HAS_NUMPY_STRINGS", False)
    monkeypatch.delattr(np, "strings")  # as where numpy has none: not touched
    assert fast_scan_refuses(tmp_path / "0.tar")
    stepped_aside = scan_shards(tmp_path, ["0.tar", "1.tar"])
    assert stepped_aside.labels.tolist() == fast.labels.tolist()
    assert stepped_aside.keys.blob.tobytes() == fast.keys.blob.tobytes()
    assert stepped_aside.members.extensions == fast.members.extensions
    for name, arr in fast.members.arrays.items():
        assert np.array_equal(arr, stepped_aside.members.arrays[name]), name
    assert stepped_aside.flaws == fast.flaws == {30: "two members x.jpg", 61: "two members x.jpg"}


def test_a_damaged_first_header_costs_its_sample_not_the_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(["a", "b", "c"]), tarfile.GNU_FORMAT)
    with open(shard, "r+b") as f:
        f.seek(10)
        f.write(b"garbage")
    with caplog.at_level(logging.WARNING):
        index = build_index(shard)
    assert "shard s.tar: damaged tar header at offset 0; resumed at offset 1024" in caplog.text
    assert [index.relpath(i) for i in range(len(index))] == ["s.tar:a", "s.tar:b", "s.tar:c"]
    assert index.flaws == {0: "tar header damaged at offset 0 of s.tar"}
    assert list(members_of(index, 0)) == ["cls"]
    assert index.labels.tolist() == [0, 1, 2]
    assert_same_scans(tmp_path, ["s.tar"])


def test_a_file_without_a_valid_tar_header_is_refused(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", b"x" * 2000)], tarfile.GNU_FORMAT)
    with open(shard, "r+b") as f:
        f.seek(10)
        f.write(b"garbage")  # its only header
    for fast in (True, False):
        with pytest.raises(DatasetError, match=r"shard s\.tar is not a tar file \(no valid tar header"):
            scan_shards(tmp_path, ["s.tar"], fast=fast)
    (tmp_path / "short.tar").write_bytes(b"ustar")
    with pytest.raises(DatasetError, match=r"shard short\.tar is not a tar file"):
        build_index(tmp_path / "short.tar")


def test_a_base256_size_takes_the_careful_scan(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", samples(["a", "b"]), tarfile.GNU_FORMAT)
    at = header_offsets(shard)["b.jpg"]
    data = bytearray(shard.read_bytes())
    data[at + 124 : at + 136] = b"\x80" + (len(b"image b")).to_bytes(11, "big")
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
    shard.write_bytes(bytes(data))
    index = build_index(shard)
    assert index_data(index, 1) == {"jpg": b"image b", "cls": b"1\n"}


# --- tar: shards and patterns ------------------------------------------------------------------------


def test_brace_patterns() -> None:
    assert expand_braces("s-{000..003}.tar") == [f"s-{i:03d}.tar" for i in range(4)]
    assert expand_braces("s-{8..10}.tar") == ["s-8.tar", "s-9.tar", "s-10.tar"]
    assert expand_braces("{a,b}/{1..2}.tar") == ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]
    assert expand_braces("{x,{y,z}1}") == ["x", "y1", "z1"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("odd{name}.tar") == ["odd{name}.tar"]
    with pytest.raises(DatasetError, match="more than"):
        expand_braces("{0..99999}{0..99}")


def test_shards_from_a_pattern_a_folder_or_a_file(tmp_path: Path) -> None:
    for s in range(3):
        write_tar(tmp_path / f"train-{s:02d}.tar", samples([f"k{s}"]))
    (tmp_path / ".partial.tar").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a shard")
    pattern = f"{tmp_path}/train-{{00..02}}.tar"
    assert list_shards(pattern) == (tmp_path, ("train-00.tar", "train-01.tar", "train-02.tar"))
    assert list_shards(tmp_path) == list_shards(pattern)
    assert list_shards(tmp_path / "train-01.tar") == (tmp_path, ("train-01.tar",))
    index = build_index(f"{tmp_path}/train-{{00..01}}.tar")
    assert [index.relpath(i) for i in range(len(index))] == ["train-00.tar:k0", "train-01.tar:k1"]
    with pytest.raises(DatasetError, match=r"shard train-03\.tar does not exist"):
        build_index(f"{tmp_path}/train-{{00..03}}.tar")


@pytest.mark.parametrize(
    ("magic", "kind"),
    [
        (b"\x1f\x8b\x08", "gzip"),
        (b"BZh91AY", "bzip2"),
        (b"\xfd7zXZ\x00\x00", "xz"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
    ],
)
def test_compressed_shards_are_refused(tmp_path: Path, magic: bytes, kind: str) -> None:
    (tmp_path / "s.tar").write_bytes(magic + bytes(600))
    with pytest.raises(DatasetError, match=rf"shard s\.tar is {kind}-compressed"):
        build_index(tmp_path / "s.tar")


def test_shards_that_cannot_be_indexed(tmp_path: Path) -> None:
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "a.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DatasetError, match="holds only compressed shards"):
        build_index(tmp_path / "only")
    (tmp_path / "text.tar").write_text("hello" * 200)
    with pytest.raises(DatasetError, match=r"text\.tar is not a tar file"):
        build_index(tmp_path / "text.tar")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.tar").write_bytes(b"")
    write_tar(tmp_path / "empty" / "b.tar", [("README", b"nothing keyed")])
    with pytest.raises(DatasetError, match="hold no samples"):
        build_index(tmp_path / "empty")
    os.mkfifo(tmp_path / "fifo.tar")
    with pytest.raises(DatasetError, match=r"fifo\.tar is not a regular file"):
        build_index(tmp_path / "fifo.tar")  # and does not block opening it


# --- the index command -----------------------------------------------------------------------------


def test_index_command_prints_each_source(tmp_path: Path) -> None:
    write_tar(tmp_path / "s.tar", samples(["a", "b"]))
    (tmp_path / "l.csv").write_text("path,label\nx.jpg,4\n")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loader_service", "index", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60, check=False)

    assert run("--data", str(tmp_path / "s.tar")).stdout == "0\t0\ts.tar:a\n1\t1\ts.tar:b\n"
    assert run("--data", str(tmp_path / "l.csv"), "--format", "list").stdout == "0\t4\tx.jpg\n"
    failed = run("--data", str(tmp_path / "l.csv"), "--format", "tar")
    assert failed.returncode == 2 and "l.csv is not a tar file" in failed.stderr
