"""The ImageFolder source: one sub-folder per class, in torchvision's ``ImageFolder`` order.

Class folders sorted by name, label = position; within a class, ``sorted(os.walk(class_dir,
followlinks=True))`` and each folder's file names sorted. Hidden files and folders (a leading dot) are
skipped; directories are never samples.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from loader_service.dataset.format import Columns, Format, IndexPart, Mapped, Progress, Scanned
from loader_service.dataset.formats.perfile import FilePerSample
from loader_service.dataset.tables import (
    I64,
    DatasetError,
    StringTable,
    StringTableBuilder,
    encode_name,
    packed,
)

if TYPE_CHECKING:
    from loader_service.dataset.storage.location import Location

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class FolderScan(NamedTuple):
    classes: tuple[str, ...]
    labels: I64
    paths: StringTable


def is_visible(name: str) -> bool:
    return not name.startswith(".")


def _is_image(name: str) -> bool:
    return is_visible(name) and name.lower().endswith(EXTENSIONS)


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
        dirs[:] = [d for d in dirs if is_visible(d)]
        walked.append((root, files))
    for root, files in sorted(walked):
        yield root, sorted(files)


def find_classes(root: Path) -> list[str]:
    with os.scandir(root) as it:
        return sorted(e.name for e in it if is_visible(e.name) and e.is_dir())


def scan_folder(root: Path, progress: Callable[[int], None] | None = None) -> FolderScan:
    """Scan ``root`` once. ``progress(found_so_far)`` is called every 10,000 files on large trees."""
    if not root.is_dir():
        raise DatasetError(f"data directory {root} does not exist")
    classes = find_classes(root)
    if not classes:
        raise DatasetError(f"no class folders in {root}: expected one sub-folder per class (ImageFolder)")
    paths = StringTableBuilder()
    labels = array("q")
    for label, name in enumerate(classes):
        before = len(labels)
        for folder, files in _walk_sorted(str(root / name)):
            rel_folder = os.path.relpath(folder, root)
            for fname in files:
                full = os.path.join(folder, fname)
                if not _is_image(fname) or os.path.isdir(full):
                    continue
                paths.add(encode_name(os.path.join(rel_folder, fname)))
                labels.append(label)
                if progress is not None and len(labels) % 10_000 == 0:
                    progress(len(labels))
        if len(labels) == before:
            raise DatasetError(
                f"class folder {name!r} in {root} holds no image files ({', '.join(EXTENSIONS)})"
            )
    return FolderScan(tuple(classes), packed(labels, np.int64), paths.build())


def holds_class_folders(root: Path) -> bool:
    return bool(find_classes(root))


class FolderFormat(FilePerSample):
    """``--format imagefolder`` (``dataset.format.Format``)."""

    name = "imagefolder"
    what = "a folder of class sub-folders"
    holds = "sub-folders (an ImageFolder?)"
    in_store = ""  # a store has no folders to list cheaply: shards or a list there

    def claims_folder(self, root: Path) -> bool:
        # A datasets DatasetDict's sub-folders are its splits, never classes: the arrow format's.
        return holds_class_folders(root) and not (root / "dataset_dict.json").is_file()

    def claims_file(self, name: str) -> bool:
        return False

    def claims_pattern(self, text: str) -> bool:
        return False

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        root = data.path
        found = scan_folder(root, progress)
        return Scanned(root, found.classes, found.labels, found.paths)

    def inputs(self, data: Location) -> Any:
        """Every folder's mtime: adding, removing or renaming a file changes its folder's."""
        return [
            [os.path.relpath(folder, data.path), os.stat(folder).st_mtime_ns]
            for folder, _, _ in os.walk(data.path, followlinks=True)
        ]

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        return None


FORMAT: Format = FolderFormat()
