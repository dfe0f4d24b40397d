"""The dataset index follows torchvision's ImageFolder order, compactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader_service.dataset.index import EXTENSIONS, DatasetError, DatasetIndex, build_index


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
    loaded = DatasetIndex.load(saved, data)
    assert [loaded.relpath(i) for i in range(3)] == [index.relpath(i) for i in range(3)]
    assert loaded.fingerprint() == index.fingerprint()
    touch(data, "b/z.jpg")
    assert build_index(data).fingerprint() != index.fingerprint()


def test_a_large_index_is_compact(tmp_path: Path) -> None:
    n = 20_000
    for c in range(2):
        d = tmp_path / f"c{c}"
        d.mkdir()
        for i in range(n // 2):
            (d / f"img_{i:08d}.jpg").touch()
    index = build_index(tmp_path)
    assert len(index) == n
    nbytes = index.labels.nbytes + index.path_offsets.nbytes + index.path_blob.nbytes
    assert nbytes < 40 * n, f"{nbytes / n:.0f} bytes per sample"
