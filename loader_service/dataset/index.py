"""The dataset index: which file is sample ``i`` and what its label is, held in a few numpy arrays.

Order matches torchvision's ``ImageFolder``: class folders sorted by name, label = position; within a
class, ``sorted(os.walk(class_dir, followlinks=True))`` and each folder's file names sorted. Hidden files
and folders (a leading dot) are skipped; directories are never samples.

A million paths as Python strings cost ~100 MB per process; here they are one utf-8 blob plus an
offsets array (~60 MB for a million typical paths), saved as .npy files that every decode worker maps
read-only, so the page cache holds one copy for all of them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class DatasetError(ValueError):
    """The data directory cannot be indexed (missing, no classes, an empty class)."""


@dataclass(frozen=True)
class DatasetIndex:
    root: Path
    classes: tuple[str, ...]
    labels: npt.NDArray[np.int64]
    path_offsets: npt.NDArray[np.int64]
    """``len + 1`` offsets into ``path_blob``; sample i is ``blob[off[i]:off[i+1]]``."""
    path_blob: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> str:
        start, end = int(self.path_offsets[i]), int(self.path_offsets[i + 1])
        return self.path_blob[start:end].tobytes().decode("utf-8", "surrogateescape")

    def path(self, i: int) -> Path:
        return self.root / self.relpath(i)

    def fingerprint(self) -> str:
        """Identifies the dataset's order and labels, so a trainer can refuse a state from another one."""
        h = hashlib.sha256()
        for arr in (self.labels, self.path_offsets, self.path_blob):
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
        return h.hexdigest()[:32]

    def save(self, directory: Path) -> None:
        """Write the arrays where workers can map them (``load(..., mmap=True)``)."""
        np.save(directory / "labels.npy", self.labels)
        np.save(directory / "path_offsets.npy", self.path_offsets)
        np.save(directory / "path_blob.npy", self.path_blob)
        (directory / "classes.txt").write_text(
            "\n".join(self.classes), encoding="utf-8", errors="surrogateescape"
        )

    @classmethod
    def load(cls, directory: Path, root: Path) -> DatasetIndex:
        text = (directory / "classes.txt").read_text(encoding="utf-8", errors="surrogateescape")
        return cls(
            root=root,
            classes=tuple(text.split("\n")) if text else (),
            labels=np.load(directory / "labels.npy", mmap_mode="r"),
            path_offsets=np.load(directory / "path_offsets.npy", mmap_mode="r"),
            path_blob=np.load(directory / "path_blob.npy", mmap_mode="r"),
        )


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _is_image(name: str) -> bool:
    return _visible(name) and name.lower().endswith(EXTENSIONS)


def _walk_sorted(class_dir: str) -> Iterator[tuple[str, list[str]]]:
    """``sorted(os.walk(followlinks=True))`` minus hidden entries, without looping on cyclic links."""
    seen: set[tuple[int, int]] = set()
    walked = []
    for root, dirs, files in os.walk(class_dir, followlinks=True):
        st = os.stat(root)
        key = (st.st_dev, st.st_ino)
        if key in seen:  # a symlink back into a folder already walked
            dirs[:] = []
            continue
        seen.add(key)
        dirs[:] = [d for d in dirs if _visible(d)]
        walked.append((root, files))
    for root, files in sorted(walked):
        yield root, sorted(files)


def find_classes(root: Path) -> list[str]:
    with os.scandir(root) as it:
        return sorted(e.name for e in it if _visible(e.name) and e.is_dir())


def build_index(root: Path, progress: Callable[[int], None] | None = None) -> DatasetIndex:
    """Scan ``root`` once. ``progress(found_so_far)`` is called every 10,000 files on large trees."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"data directory {root} does not exist")
    classes = find_classes(root)
    if not classes:
        raise DatasetError(f"no class folders in {root}: expected one sub-folder per class (ImageFolder)")
    blob = bytearray()
    offsets: list[int] = [0]
    labels: list[int] = []
    for label, name in enumerate(classes):
        before = len(labels)
        for folder, files in _walk_sorted(str(root / name)):
            rel_folder = os.path.relpath(folder, root)
            for fname in files:
                full = os.path.join(folder, fname)
                if not _is_image(fname) or os.path.isdir(full):
                    continue
                blob += os.path.join(rel_folder, fname).encode("utf-8", "surrogateescape")
                offsets.append(len(blob))
                labels.append(label)
                if progress is not None and len(labels) % 10_000 == 0:
                    progress(len(labels))
        if len(labels) == before:
            raise DatasetError(
                f"class folder {name!r} in {root} holds no image files ({', '.join(EXTENSIONS)})"
            )
    return DatasetIndex(
        root=root,
        classes=tuple(classes),
        labels=np.asarray(labels, dtype=np.int64),
        path_offsets=np.asarray(offsets, dtype=np.int64),
        path_blob=np.frombuffer(bytes(blob), dtype=np.uint8),
    )
