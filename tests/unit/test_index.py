"""The dataset index: ImageFolder order as torchvision's, the format of each source, compactly saved."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from loader_service.dataset.index import (
    EXTENSIONS,
    FORMAT_CHOICES,
    DatasetError,
    DatasetIndex,
    build_index,
    detect_format,
)
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import ListMetadata


def touch(root: Path, *paths: str) -> None:
    for p in paths:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_bytes(b"x")


def imagefolder_reference(root: Path) -> list[tuple[str, int]]:
    """torchvision.datasets.folder.make_dataset, restated (plus the hidden-entry rule)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    out = []
    for label, cls in enumerate(classes):
        for folder, _dirs, files in sorted(os.walk(root / cls, followlinks=True)):
            if any(part.startswith(".") for part in Path(folder).relative_to(root).parts):
                continue
            for f in sorted(files):
                if f.lower().endswith(EXTENSIONS) and not f.startswith("."):
                    out.append((os.path.relpath(os.path.join(folder, f), root), label))
    return out


def test_order_and_labels_match_imagefolder(tmp_path: Path) -> None:
    touch(
        tmp_path,
        "dog/b.jpg",
        "dog/a.JPG",
        "dog/a/x.png",
        "dog/a/y.txt",
        "dog/.hidden.jpg",
        "dog/.cache/z.jpg",
        "dog/z/w.webp",
        "cat/1.tiff",
        "cat/sub/2.bmp",
        "cat/0.jpeg",
        "ant/x.tif",
        ".git/objects/q.jpg",
    )
    (tmp_path / "cat" / "folder.jpg").mkdir()  # a directory is never a sample
    index = build_index(tmp_path)
    got = [(index.relpath(i), int(index.labels[i])) for i in range(len(index))]
    assert got == imagefolder_reference(tmp_path)
    assert index.classes == ("ant", "cat", "dog")
    assert got == [
        ("ant/x.tif", 0),
        ("cat/0.jpeg", 1),
        ("cat/1.tiff", 1),
        ("cat/sub/2.bmp", 1),
        ("dog/a.JPG", 2),
        ("dog/b.jpg", 2),
        ("dog/a/x.png", 2),
        ("dog/z/w.webp", 2),
    ]


def test_symlink_loops_do_not_hang_and_linked_files_count(tmp_path: Path) -> None:
    data = tmp_path / "data"
    touch(data, "a/one.jpg")
    touch(tmp_path, "outside/two.jpg")
    os.symlink(data / "a", data / "a" / "loop")
    os.symlink(tmp_path / "outside" / "two.jpg", data / "a" / "link.jpg")
    index = build_index(data)
    assert [index.relpath(i) for i in range(len(index))] == ["a/link.jpg", "a/one.jpg"]


def test_empty_or_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        build_index(tmp_path / "missing")
    with pytest.raises(DatasetError, match="no class folders"):
        build_index(tmp_path)
    touch(tmp_path, "a/x.jpg", "b/readme.txt")
    with pytest.raises(DatasetError, match=r"'b'.*holds no image files"):
        build_index(tmp_path)


def test_save_load_and_fingerprint(tmp_path: Path) -> None:
    data, saved = tmp_path / "data", tmp_path / "saved"
    saved.mkdir()
    touch(data, "a/x.jpg", "b/y.jpg", "b/ü.png")
    index = build_index(data)
    index.save(saved)
    loaded = DatasetIndex.load(saved)
    assert [loaded.relpath(i) for i in range(3)] == [index.relpath(i) for i in range(3)]
    assert loaded.path(2) == data / "b" / "ü.png"
    assert loaded.fingerprint() == index.fingerprint()
    touch(data, "b/z.jpg")
    assert build_index(data).fingerprint() != index.fingerprint()


def test_the_image_folder_fingerprint_is_the_one_saved_states_hold(tmp_path: Path) -> None:
    """As computed before list and tar sources existed: a trainer's saved state stays valid."""
    touch(tmp_path, "a/x.jpg", "b/y.jpg", "b/ü.png")
    index = build_index(tmp_path)
    h = hashlib.sha256()
    for arr in (index.labels, index.names.offsets, index.names.blob):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(b"a\0b")
    assert index.fingerprint() == h.hexdigest()[:32]
    assert index.names.offsets.dtype == np.int64 and index.labels.dtype == np.int64


def test_a_large_index_is_compact(tmp_path: Path) -> None:
    n = 20_000
    for c in range(2):
        d = tmp_path / f"c{c}"
        d.mkdir()
        for i in range(n // 2):
            (d / f"img_{i:08d}.jpg").touch()
    index = build_index(tmp_path)
    assert len(index) == n
    nbytes = index.labels.nbytes + index.names.nbytes
    assert index.nbytes == nbytes < 40 * n, f"{nbytes / n:.0f} bytes per sample"


# --- every source ---------------------------------------------------------------------------------


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    """One small dataset of each kind, with metadata where the kind has it."""
    touch(tmp_path / "folder", "cat/1.jpg", "dog/2.jpg")
    (tmp_path / "list.csv").write_text("path,label,caption\na.jpg,1,one\nb.jpg,,two\n")
    (tmp_path / "list.jsonl").write_text('{"path": "a.jpg", "label": 3, "box": [1, 2]}\n{"path": "b.jpg"}\n')
    (tmp_path / "shards").mkdir()
    members = [("k0.jpg", b"img0"), ("k0.cls", b"2"), ("k0.json", b"{}"), ("k1.png", b"img1")]
    write_tar(tmp_path / "shards" / "s-0.tar", members)
    write_tar(tmp_path / "shards" / "s-1.tar", [("k2.jpg", b"img2"), ("k2.cls", b"x")])
    return {
        "imagefolder": tmp_path / "folder",
        "csv": tmp_path / "list.csv",
        "jsonl": tmp_path / "list.jsonl",
        "tar": tmp_path / "shards",
    }


def test_detect_format(sources: dict[str, Path], tmp_path: Path) -> None:
    assert [detect_format(p) for p in sources.values()] == ["imagefolder", "list", "list", "tar"]
    assert detect_format(sources["tar"] / "s-0.tar") == "tar"
    assert detect_format(f"{sources['tar']}/s-{{0..1}}.tar") == "tar"
    assert FORMAT_CHOICES == ("auto", "imagefolder", "list", "parquet", "tfrecord", "tar", "zip", "arrow")
    touch(tmp_path / "both", "cls/x.jpg")
    write_tar(tmp_path / "both" / "s.tar", [("a.jpg", b"x")])
    with pytest.raises(DatasetError, match=r"both sub-folders .* and .tar files"):
        detect_format(tmp_path / "both")
    assert build_index(tmp_path / "both", "imagefolder").classes == ("cls",)
    assert len(build_index(tmp_path / "both", "tar")) == 1
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "x.parquet").write_bytes(b"PAR1")
    assert detect_format(tmp_path / "pq" / "x.parquet") == detect_format(tmp_path / "pq") == "parquet"
    assert detect_format(f"{tmp_path}/pq/x-{{0..3}}.parquet") == "parquet"
    (tmp_path / "x.zip").write_bytes(b"PK")
    assert detect_format(tmp_path / "x.zip") == "zip"
    (tmp_path / "x.rar").write_bytes(b"Rar!")
    with pytest.raises(DatasetError, match=r"cannot tell the format of .*x\.rar.*--format"):
        detect_format(tmp_path / "x.rar")
    with pytest.raises(DatasetError, match="does not exist"):
        detect_format(tmp_path / "nothing.csv")
    with pytest.raises(DatasetError, match="format must be one of"):
        build_index(sources["csv"], "rar")


@pytest.mark.parametrize("kind", ["imagefolder", "csv", "jsonl", "tar"])
def test_every_source_saves_and_loads_mapped_read_only(
    sources: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    index = build_index(sources[kind])
    saved = tmp_path / "saved"
    saved.mkdir()
    index.save(saved)
    loaded = DatasetIndex.load(saved)
    assert (loaded.kind, loaded.classes, loaded.num_classes) == (index.kind, index.classes, index.num_classes)
    assert loaded.root == sources[kind].parent if kind in ("csv", "jsonl") else sources[kind]
    assert [loaded.relpath(i) for i in range(len(loaded))] == [index.relpath(i) for i in range(len(index))]
    assert [loaded.path(i) for i in range(len(loaded))] == [index.path(i) for i in range(len(index))]
    assert loaded.labels.tolist() == index.labels.tolist()
    assert loaded.flaws == index.flaws
    assert loaded.fingerprint() == index.fingerprint()
    assert isinstance(loaded.labels, np.memmap) and not loaded.labels.flags.writeable
    if isinstance(index.part, ListMetadata):
        assert isinstance(loaded.part, ListMetadata)
        assert [loaded.part.items(i) for i in range(len(index))] == [
            index.part.items(i) for i in range(len(index))
        ]


def test_what_each_source_indexes(sources: dict[str, Path]) -> None:
    folder, csv, jsonl, tar = (build_index(p) for p in sources.values())
    assert (folder.kind, folder.classes, folder.labels.tolist(), folder.num_classes) == (
        "imagefolder",
        ("cat", "dog"),
        [0, 1],
        2,
    )
    assert (csv.kind, csv.classes, csv.labels.tolist(), csv.num_classes) == ("list", (), [1, -1], 2)
    assert jsonl.labels.tolist() == [3, -1]
    assert (tar.kind, tar.labels.tolist(), tar.num_classes) == ("tar", [2, -1, -1], 3)
    assert [tar.relpath(i) for i in range(3)] == ["s-0.tar:k0", "s-0.tar:k1", "s-1.tar:k2"]
    assert tar.path(2) == sources["tar"] / "s-1.tar"
    assert tar.flaws == {2: "label member k2.cls is not an integer: b'x'"}


def test_fingerprints_follow_order_and_labels_not_the_data_folder(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "l.csv").write_text("path,label\nx.jpg,1\ny.jpg,2\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "l.csv").write_text("path,label\nx.jpg,1\ny.jpg,2\n")
    (tmp_path / "c.csv").write_text("path,label\nx.jpg,1\ny.jpg,3\n")
    (tmp_path / "d.csv").write_text("path,label\ny.jpg,2\nx.jpg,1\n")
    prints = [build_index(tmp_path / p).fingerprint() for p in ("a/l.csv", "b/l.csv", "c.csv", "d.csv")]
    assert prints[0] == prints[1]
    assert len(set(prints)) == 3
    write_tar(tmp_path / "1.tar", [("k.jpg", b"x"), ("k.cls", b"1")])
    write_tar(tmp_path / "2.tar", [("k.jpg", b"x"), ("k.cls", b"2")])
    assert build_index(tmp_path / "1.tar").fingerprint() != build_index(tmp_path / "2.tar").fingerprint()


def test_where_data_is_is_told_once_from_its_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ One location ]: a store's URL (any case of its scheme) is in the store and kept as
    given; anything else is a local path, made absolute against the cwd of whoever tells."""
    for url in ("s3://bucket/shards/", "GS://bucket/x.tar", "az://container/list.csv"):
        where = Location.of(url)
        assert where.in_store and where.absolute() == where and str(where) == url
    monkeypatch.chdir(tmp_path)
    local = Location.of("data/train-{0..3}.tar")
    assert not local.in_store and local.path == Path("data/train-{0..3}.tar")
    assert local.absolute().text == str(tmp_path / "data" / "train-{0..3}.tar")
    options = StorageConfig(options=(("allow_http", "true"),))
    assert Location.of(local, options).storage == options and Location.of(local) is local
