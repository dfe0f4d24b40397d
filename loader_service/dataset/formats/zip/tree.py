"""A zip archive's members as the ImageFolder they would be if extracted: its classes, its samples in
``ImageFolder``'s order, and the members that cannot be read.

NOTE [ Zip as an ImageFolder ]
    An archive's entries may come in any order (a tool that zipped in parallel, an appended file),
    so its samples are ordered as ``folder.scan_folder`` orders the extracted folder, never by the
    directory: class folders sorted by name, label = position; within a class, folders sorted by
    their path and each folder's files by name; only the image extensions an ImageFolder takes;
    hidden files and folders (a leading dot) skipped, and macOS's ``__MACOSX`` folder of resource
    forks, which is no class. An archive whose entries all sit in one folder (``train.zip`` made
    by zipping ``train/``) is read from inside that folder. A name that two entries share is
    refused: which one the sample is could not be told. Encrypted members and compression methods
    other than stored and deflated are flaws, named, each costing its sample only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from loader_service.dataset.formats.folder import EXTENSIONS, is_visible
from loader_service.dataset.formats.zip.central import Entries
from loader_service.dataset.tables import DatasetError

STORED, DEFLATED = 0, 8
METHODS = {STORED: "stored", DEFLATED: "deflated"}
KNOWN_METHODS = {9: "Deflate64", 12: "bzip2", 14: "LZMA", 93: "Zstandard", 95: "XZ", 99: "AES"}
ENCRYPTED = 0x1
RESOURCE_FORKS = "__MACOSX"


@dataclass(frozen=True)
class Tree:
    classes: tuple[str, ...]
    order: list[int]
    """The entries that are samples, in the index's order."""
    labels: list[int]
    flaws: dict[int, str]
    """By sample number: why its member cannot be read."""


def as_image_folder(entries: Entries, where: str) -> Tree:
    """The samples of the archive's entries (NOTE [ Zip as an ImageFolder ])."""
    paths = {k: _parts(name) for k, name in enumerate(entries.names)}
    kept = {k: parts for k, parts in paths.items() if parts}
    images = {
        k: parts for k, parts in kept.items() if not entries.names[k].endswith("/") and _is_image(parts)
    }
    if (
        images
        and len({parts[0] for parts in kept.values()}) == 1
        and all(len(p) >= 3 for p in images.values())
    ):
        kept = {k: parts[1:] for k, parts in kept.items() if len(parts) > 1}
        images = {k: kept[k] for k in images}
    folders = sorted(
        {parts[0] for k, parts in kept.items() if len(parts) > 1 or entries.names[k].endswith("/")}
    )
    if not folders:
        raise DatasetError(
            f"no class folders in zip archive {where}: expected one folder per class inside it"
        )
    _refuse_duplicates(entries, images, where)
    label_of = {name: label for label, name in enumerate(folders)}
    keyed = sorted(
        (label_of[parts[0]], "/".join(parts[:-1]), parts[-1], k)
        for k, parts in images.items()
        if len(parts) > 1
    )
    labels = [label for label, *_ in keyed]
    empty = sorted(set(folders) - {folders[label] for label in labels})
    if empty:
        raise DatasetError(
            f"class folder {empty[0]!r} in zip archive {where} holds no image files ({', '.join(EXTENSIONS)})"
        )
    order = [k for *_, k in keyed]
    flaws = {i: why for i, k in enumerate(order) if (why := flaw(entries, k))}
    return Tree(tuple(folders), order, labels, flaws)


def flaw(entries: Entries, k: int) -> str:
    """Why entry ``k``'s data cannot be read, or ""."""
    method = entries.methods[k]
    if entries.flags[k] & ENCRYPTED:
        return "its member is encrypted: zip encryption is not supported"
    if method not in METHODS:
        name = KNOWN_METHODS.get(method, "unknown")
        return f"its member is compressed with method {method} ({name}): only stored and deflated are read"
    if min(entries.offsets[k], entries.compressed[k], entries.sizes[k]) < 0:
        return "its central directory entry lacks the ZIP64 sizes it says it has"
    if entries.offsets[k] + entries.compressed[k] > entries.data_end:
        return f"its {entries.compressed[k]} bytes at {entries.offsets[k]} run into the central directory"
    return ""


def _parts(name: str) -> tuple[str, ...]:
    """The name's folders and file, or () for an entry no ImageFolder would see."""
    parts = tuple(p for p in name.split("/") if p)
    if not parts or parts[0] == RESOURCE_FORKS or not all(is_visible(p) for p in parts):
        return ()
    return parts


def _is_image(parts: tuple[str, ...]) -> bool:
    return parts[-1].lower().endswith(EXTENSIONS)


def _refuse_duplicates(entries: Entries, images: dict[int, tuple[str, ...]], where: str) -> None:
    counts = Counter(entries.names[k] for k in images)
    twice = sorted(name for name, n in counts.items() if n > 1)
    if twice:
        raise DatasetError(
            f"zip archive {where} holds {counts[twice[0]]} entries named {twice[0]!r} "
            f"({len(twice)} such name(s)): which one is the sample cannot be told; rebuild the archive"
        )
