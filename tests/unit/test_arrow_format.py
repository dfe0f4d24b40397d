"""The arrow format: folders ``datasets.save_to_disk`` writes, indexed batch by batch and read by
range (NOTE [ Arrow offsets ])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loader_service.dataset.format import Columns
from loader_service.dataset.formats import detect_format
from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.dataset.tables import DatasetError
from loader_service.decode.reading import SampleReader
from loader_service.tools.sample_data import make_sample_dataset
from protocol.pixels import DecodeError
from testkit.fixtures import write_save_to_disk

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
MAX = 1 << 28


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("arrowsrc") / "data"
    make_sample_dataset(root, classes=3, per_class=5, seed=5)
    return root


@pytest.fixture(scope="module")
def saved(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_save_to_disk(folder, tmp_path_factory.mktemp("saved") / "train", shards=2)


def test_a_saved_folder_is_its_rows_in_order_with_their_labels_and_bytes(folder: Path, saved: Path) -> None:
    assert detect_format(saved) == detect_format(saved / "state.json") == "arrow"
    plain, index = build_index(folder), build_index(saved)
    files = json.loads((saved / "state.json").read_text())["_data_files"]
    assert len(files) == 2, "two Arrow files, read in state.json's order"
    assert index.kind == "arrow" and len(index) == len(plain)
    assert index.classes == plain.classes, "the ClassLabel's names"
    assert list(index.labels) == list(plain.labels)
    assert index.relpath(0) == f"{files[0]['filename']}:0"
    assert index.relpath(len(index) - 1).startswith(files[1]["filename"])
    reader, expected = SampleReader(index, MAX), SampleReader(plain, MAX)
    assert all(reader.image_bytes(i) == expected.image_bytes(i) for i in range(len(plain)))
    (saved.parent / "index").mkdir(exist_ok=True)
    index.save(saved.parent / "index")
    loaded = DatasetIndex.load(saved.parent / "index")
    assert loaded.fingerprint() == index.fingerprint()
    assert SampleReader(loaded, MAX).image_bytes(7) == expected.image_bytes(7)


def test_a_dataset_dict_is_refused_naming_its_splits(folder: Path, tmp_path: Path) -> None:
    one = datasets.load_from_disk(str(write_save_to_disk(folder, tmp_path / "one", shards=1)))
    datasets.DatasetDict({"train": one, "validation": one}).save_to_disk(str(tmp_path / "dict"))
    assert detect_format(tmp_path / "dict") == "arrow", "its splits are no class folders"
    with pytest.raises(DatasetError, match=r"DatasetDict of splits train, validation: give one split's"):
        build_index(tmp_path / "dict")


def test_path_only_and_null_images_are_flaws_named(tmp_path: Path, folder: Path) -> None:
    """``datasets`` embeds a local path's bytes when it saves, so the path-only row (an image left
    on another host) is written into its file as such, with its schema and metadata kept."""
    photo = next(folder.rglob("*.jpg")).read_bytes()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    table = {"image": [{"bytes": photo, "path": None}] * 3, "label": [0, 1, None]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "d"))
    (name,) = [p for p in (tmp_path / "d").iterdir() if p.suffix == ".arrow"]
    saved = pa.ipc.open_stream(name.read_bytes()).read_all()
    kind = saved.schema.field("image").type
    image = pa.StructArray.from_arrays(
        [pa.array([photo, None, None], kind.field("bytes").type), pa.array([None, "far/x.jpg", None])],
        fields=list(kind),
        mask=pa.array([False, False, True]),
    )
    rewritten = saved.set_column(0, "image", image)
    with pa.OSFile(str(name), "wb") as sink, pa.ipc.new_stream(sink, saved.schema) as out:
        out.write_table(rewritten.cast(saved.schema))
    index = build_index(tmp_path / "d")
    assert list(index.labels) == [0, 1, -1]
    assert index.flaws == {
        1: "its image is only a path (datasets' Image feature without bytes): not read",
        2: "its image is null",
    }
    assert SampleReader(index, MAX).image_bytes(0) == photo


def test_a_compressed_file_is_refused_by_name(tmp_path: Path, saved: Path) -> None:
    copy = tmp_path / "zstd"
    shutil.copytree(saved, copy)
    name = json.loads((copy / "state.json").read_text())["_data_files"][0]["filename"]
    table = pa.ipc.open_stream((copy / name).read_bytes()).read_all()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with (
        pa.OSFile(str(copy / name), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema, options=options) as out,
    ):
        out.write_table(table)
    with pytest.raises(DatasetError, match=rf"{name}: its buffers are compressed"):
        build_index(copy)


def test_damage_is_named_and_sizes_are_bounded(tmp_path: Path, saved: Path) -> None:
    copy = tmp_path / "cut"
    shutil.copytree(saved, copy)
    name = json.loads((copy / "state.json").read_text())["_data_files"][1]["filename"]
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match=rf"{name}: a record batch after row \d+ is damaged"):
        build_index(copy)
    with pytest.raises(DecodeError, match="is over --max-file-bytes 1000"):
        SampleReader(build_index(saved), 1000).image_bytes(0)
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"].append({"filename": "data-missing.arrow"})
    shutil.copytree(saved, tmp_path / "listed")
    (tmp_path / "listed" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DatasetError, match=r"lists data-missing.arrow, which is not in"):
        build_index(tmp_path / "listed")
    with pytest.raises(DatasetError, match=r"has no image column 'picture'.*--image-column"):
        build_index(saved, "arrow", columns=Columns(image="picture"))
