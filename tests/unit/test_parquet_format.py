"""The Parquet source: files written by Hugging Face ``datasets`` and by plain pyarrow, indexed from
their footers and read a page (or a value) at a time (NOTE [ Parquet reads ])."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader_service.dataset.format import Columns
from loader_service.dataset.formats.parquet import format as parquet
from loader_service.dataset.formats.parquet.reader import ParquetReader
from loader_service.dataset.index import build_index
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import SampleReader
from protocol.pixels import DecodeError
from testkit.counting import CountingFiles
from tests.helpers import folder_samples, write_parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_files_written_by_datasets_give_the_photos_their_labels_classes_and_captions(
    photos: Path, tmp_path: Path
) -> None:
    folder = write_parquet(photos, tmp_path / "pq", files=2)
    index = build_index(folder)
    samples = folder_samples(photos)
    assert index.kind == "parquet" and len(index) == len(samples)
    assert index.labels.tolist() == [label for _, label in samples]
    assert index.classes == build_index(photos).classes, "the ClassLabel's names"
    assert index.relpath(0) == "train-00000-of-00002.parquet:0"
    assert index.relpath(len(index) - 1).startswith("train-00001-of-00002.parquet:")
    reader = SampleReader(index, 1 << 28)
    assert all(reader.image_bytes(i) == (photos / rel).read_bytes() for i, (rel, _) in enumerate(samples))
    assert {k: v() for k, v in reader.metadata(7).items()} == {"caption": "photo 7"}


def test_an_image_costs_its_own_bytes_not_its_row_group(photos: Path, tmp_path: Path) -> None:
    """``datasets`` stores images uncompressed and PLAIN, hundreds to a row group: a reader reads a
    page's levels and value lengths once, then each image alone."""
    index = build_index(write_parquet(photos, tmp_path / "pq"))
    files = CountingFiles(index.root)
    reader = ParquetReader(files, parquet._rows(index), 1 << 28, exact=True)
    image_bytes = sum(len(reader.image_bytes(i)) for i in reversed(range(len(index))))
    assert files.bytes_read / image_bytes < 1.01, (
        f"{files.bytes_read / image_bytes:.3f} bytes read per image byte"
    )
    whole = ParquetReader(CountingFiles(index.root), parquet._rows(index), 1 << 28, exact=False)
    assert [whole.image_bytes(i) for i in range(3)] == [reader.image_bytes(i) for i in range(3)]


def test_plain_pyarrow_tables_choose_their_columns(photos: Path, tmp_path: Path) -> None:
    """Binary images in a column of another name, labels too, compressed pages: read a page at a time."""
    samples = folder_samples(photos)
    table = pa.table(
        {
            "jpg": pa.array([(photos / rel).read_bytes() for rel, _ in samples], pa.binary()),
            "cls": pa.array([label for _, label in samples], pa.int32()),
            "score": [i / 2 for i in range(len(samples))],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16, compression="zstd")
    with pytest.raises(
        DatasetError, match=r"no image column 'image' \(columns: jpg, cls, score\).*--image-column"
    ):
        build_index(tmp_path / "t.parquet")
    index = build_index(tmp_path / "t.parquet", columns=Columns("jpg", "cls"))
    assert index.labels.tolist() == [label for _, label in samples] and index.classes == ()
    reader = SampleReader(index, 1 << 28)
    assert reader.image_bytes(20) == (photos / samples[20][0]).read_bytes()
    assert reader.metadata(3)["score"]() == 1.5
    unlabelled = build_index(tmp_path / "t.parquet", columns=Columns("jpg", "none"))
    assert set(unlabelled.labels.tolist()) == {-1}
    with pytest.raises(DatasetError, match="not integers"):
        build_index(tmp_path / "t.parquet", columns=Columns("jpg", "score"))


def test_a_null_or_damaged_image_is_a_bad_sample_and_the_rest_read(photos: Path, tmp_path: Path) -> None:
    samples = folder_samples(photos)[:12]
    images = [(photos / rel).read_bytes() for rel, _ in samples]
    column = pa.array([None if i == 3 else {"bytes": b, "path": "x"} for i, b in enumerate(images)])
    path = tmp_path / "n.parquet"
    pq.write_table(
        pa.table({"image": column}), path, compression="none", use_dictionary=False, row_group_size=6
    )
    index = build_index(path)
    reader = SampleReader(index, 1 << 28)
    with pytest.raises(DecodeError, match="the image is null"):
        reader.image_bytes(3)
    assert reader.image_bytes(4) == images[4]
    raw = bytearray(path.read_bytes())
    first = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    raw[first : first + 8] = b"\xff" * 8  # the second row group's page header
    path.write_bytes(bytes(raw))
    damaged = SampleReader(build_index(path), 1 << 28)
    with pytest.raises(DecodeError, match="damaged Parquet page"):
        damaged.image_bytes(7)
    assert damaged.image_bytes(2) == images[2], "the other row group reads on"


def test_files_of_other_columns_are_refused_naming_the_file(photos: Path, tmp_path: Path) -> None:
    folder = write_parquet(photos, tmp_path / "pq")
    pq.write_table(pa.table({"image": pa.array([b"x"], pa.binary()), "other": [1]}), folder / "z.parquet")
    with pytest.raises(DatasetError, match=r"z\.parquet: its columns differ from the first file's"):
        build_index(folder)
    (folder / "z.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"z\.parquet: not a readable Parquet file"):
        build_index(folder)


def test_unsigned_labels_and_columns_holding_bytes(photos: Path, tmp_path: Path) -> None:
    """Unsigned labels read as they are (nulls: -1); a second column of bytes (a mask, say) is not read
    at start as metadata; a label past 64 bits is refused."""
    samples = folder_samples(photos)[:6]
    images = [(photos / rel).read_bytes() for rel, _ in samples]
    table = pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "label": pa.array([200, None, 3, 4, 5, 6], pa.uint8()),
            "mask": pa.array([{"bytes": b"m" * 10, "path": "m.png"}] * 6),
            "note": ["n"] * 6,
        }
    )
    pq.write_table(table, tmp_path / "u.parquet")
    index = build_index(tmp_path / "u.parquet")
    assert index.labels.tolist() == [200, -1, 3, 4, 5, 6]
    assert {k: v() for k, v in SampleReader(index, 1 << 28).metadata(0).items()} == {"note": "n"}
    huge = table.set_column(1, "label", pa.array([2**63 + 1] * 6, pa.uint64()))
    pq.write_table(huge, tmp_path / "h.parquet")
    with pytest.raises(DatasetError, match="must fit in 64 bits"):
        build_index(tmp_path / "h.parquet")
