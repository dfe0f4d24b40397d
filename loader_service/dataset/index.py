"""The dataset index: which bytes are sample ``i``, and its label, held in a few compact numpy arrays.

Three sources (``--format``): ``imagefolder`` (dataset.folder), ``list``, a csv or jsonl file
(dataset.filelist), and ``tar``, WebDataset-style shards (dataset.tarshards). Whatever the source, a
sample has an index (its position: the order is fixed by the source), a label (-1 when the source has
none), a name for logs and ``loader-service index`` (``relpath``), and where its image lies.

The service builds the index once at start and saves it (``save``); every decode worker maps the arrays
read-only (``load``), so the page cache holds one copy for all of them. Reading a sample's bytes is
``loader_service.decode.reading.SampleReader``'s job.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.filelist import LIST_SUFFIXES, scan_list
from loader_service.dataset.folder import EXTENSIONS, holds_class_folders, scan_folder
from loader_service.dataset.shards import (
    COMPRESSED_SUFFIXES,
    TAR_SUFFIX,
    holds_shards,
    is_brace_pattern,
    list_shards,
)
from loader_service.dataset.tables import (
    I64,
    DatasetError,
    ListMetadata,
    StringTable,
    TarMembers,
)
from loader_service.dataset.tarshards import scan_shards

__all__ = [
    "EXTENSIONS",
    "FORMATS",
    "DatasetError",
    "DatasetIndex",
    "build_index",
    "detect_format",
]

FORMATS = ("auto", "imagefolder", "list", "tar")
_SAVED_VERSION = 1


@dataclass(frozen=True)
class DatasetIndex:
    kind: str
    """``imagefolder``, ``list`` or ``tar``."""
    root: Path
    """The ImageFolder, the list file's folder, or the folder the shards are named relative to."""
    classes: tuple[str, ...]
    """ImageFolder's class names (label = position); () for list and tar."""
    labels: I64
    names: StringTable
    """Per sample: the path relative to ``root`` (imagefolder, list), or the key in its shard (tar)."""
    metadata: ListMetadata | None = None
    """A list source's other columns or keys, if it has any."""
    tar: TarMembers | None = None
    flaws: Mapping[int, str] = field(default_factory=dict)
    """Samples found unreadable while indexing (tar: a damaged header, a bad ``.cls``), and why."""

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> str:
        """How sample ``i`` is named in logs, status and ``loader-service index``; ``shard:key`` for tar."""
        if self.tar is not None:
            return f"{self.tar.shards[int(self.tar.sample_shard[i])]}:{self.names.text(i)}"
        return self.names.text(i)

    def path(self, i: int) -> Path:
        """The image file (imagefolder, list), or the shard file that holds the sample (tar)."""
        if self.tar is not None:
            return self.root / self.tar.shards[int(self.tar.sample_shard[i])]
        return self.root / self.names.text(i)

    @property
    def num_classes(self) -> int:
        if self.classes:
            return len(self.classes)
        return int(self.labels.max()) + 1 if len(self.labels) and self.labels.max() >= 0 else 0

    @property
    def nbytes(self) -> int:
        """What the index's arrays cost in memory (NOTE [ Tar index size ])."""
        return sum(int(a.nbytes) for a in self._arrays().values())

    def fingerprint(self) -> str:
        """Identifies the dataset's order and labels, so a trainer can refuse a state from another one."""
        h = hashlib.sha256()
        if self.kind == "imagefolder":  # as before list and tar sources existed: saved states stay valid
            for arr in (self.labels, self.names.offsets, self.names.blob):
                h.update(_raw(arr))
            h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
            return h.hexdigest()[:32]
        # Not the root (data may move) nor the saved-format version: the same data, the same print.
        described = {k: v for k, v in self._description().items() if k not in ("root", "version")}
        h.update(json.dumps(described, sort_keys=True).encode())
        for name, arr in sorted(self._arrays().items()):
            h.update(name.encode())
            h.update(_raw(arr))
        return h.hexdigest()[:32]

    def save(self, directory: Path) -> None:
        """Write the arrays where workers can map them (``load``)."""
        for name, arr in self._arrays().items():
            np.save(directory / f"{name}.npy", arr)
        (directory / "index.json").write_text(json.dumps(self._description()), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> DatasetIndex:
        """The index ``save`` wrote, its arrays mapped read-only."""
        desc = json.loads((directory / "index.json").read_text(encoding="utf-8"))
        if desc.get("version") != _SAVED_VERSION:
            raise DatasetError(f"{directory} holds an index of another version: {desc.get('version')}")

        def mapped(name: str) -> npt.NDArray[Any]:
            arr: npt.NDArray[Any] = np.load(directory / f"{name}.npy", mmap_mode="r")
            return arr

        metadata = tar = None
        if desc["metadata"] is not None:
            metadata = ListMetadata(
                desc["metadata"]["style"],
                tuple(desc["metadata"]["columns"]),
                StringTable(mapped("metadata_offsets"), mapped("metadata_blob")),
            )
        if desc["tar"] is not None:
            tar = TarMembers(
                shards=tuple(desc["tar"]["shards"]),
                extensions=tuple(desc["tar"]["extensions"]),
                sample_shard=mapped("sample_shard"),
                first_member=mapped("first_member"),
                member_offset=mapped("member_offset"),
                member_size=mapped("member_size"),
                member_extension=mapped("member_extension"),
            )
        return cls(
            kind=desc["kind"],
            root=Path(desc["root"]),
            classes=tuple(desc["classes"]),
            labels=mapped("labels"),
            names=StringTable(mapped("name_offsets"), mapped("name_blob")),
            metadata=metadata,
            tar=tar,
            flaws={int(k): v for k, v in desc["flaws"].items()},
        )

    def _arrays(self) -> dict[str, npt.NDArray[Any]]:
        arrays: dict[str, npt.NDArray[Any]] = {
            "labels": self.labels,
            "name_offsets": self.names.offsets,
            "name_blob": self.names.blob,
        }
        if self.metadata is not None:
            arrays["metadata_offsets"] = self.metadata.values.offsets
            arrays["metadata_blob"] = self.metadata.values.blob
        if self.tar is not None:
            arrays.update(self.tar.arrays)
        return arrays

    def _description(self) -> dict[str, Any]:
        """Everything but the arrays, as JSON."""
        metadata = tar = None
        if self.metadata is not None:
            metadata = {"style": self.metadata.style, "columns": list(self.metadata.columns)}
        if self.tar is not None:
            tar = {"shards": list(self.tar.shards), "extensions": list(self.tar.extensions)}
        return {
            "version": _SAVED_VERSION,
            "kind": self.kind,
            "root": os.path.abspath(self.root),  # workers need not share the service's working folder
            "classes": list(self.classes),
            "metadata": metadata,
            "tar": tar,
            "flaws": {str(k): v for k, v in sorted(self.flaws.items())},
        }


def _raw(arr: npt.NDArray[Any]) -> memoryview:
    # The bytes without a copy: a copy of a large index would stay in the service's heap.
    return np.ascontiguousarray(arr).data.cast("B")


def detect_format(data: str | Path) -> str:
    """``imagefolder``, ``list`` or ``tar``, from what ``data`` is; DatasetError if that is unclear.

    A folder of class sub-folders is an ImageFolder, a folder of ``.tar`` files holds shards (both at
    once is unclear); a ``.csv`` or ``.jsonl`` file is a list; a ``.tar`` file or a brace pattern that
    is not an existing path names shards.
    """
    text = str(data)
    if os.path.isdir(text):
        return _folder_format(Path(text))
    if os.path.exists(text):
        lower = text.lower()
        if lower.endswith((TAR_SUFFIX, *COMPRESSED_SUFFIXES)):
            return "tar"
        if lower.endswith(tuple(LIST_SUFFIXES)):
            return "list"
        raise DatasetError(
            f"cannot tell the format of {text}: expected a folder, a .csv, .jsonl or .tar file, or a "
            "brace pattern of shards; say which with --format"
        )
    if is_brace_pattern(text):
        return "tar"
    raise DatasetError(f"data {text} does not exist")


def _folder_format(root: Path) -> str:
    classes, shards = holds_class_folders(root), holds_shards(root)
    if classes and shards:
        raise DatasetError(
            f"{root} holds both sub-folders (an ImageFolder?) and .tar files (shards?); "
            "say which with --format imagefolder or --format tar"
        )
    return "tar" if shards else "imagefolder"


def build_index(
    data: str | Path, format: str = "auto", progress: Callable[[int], None] | None = None
) -> DatasetIndex:
    """Index ``data`` once. ``progress(found_so_far)`` is called every 10,000 samples.

    ``data``: an ImageFolder, a folder of ``*.tar`` shards, a ``.csv`` or ``.jsonl`` file, a ``.tar``
    file, or a brace pattern such as ``dir/train-{000000..000127}.tar``.
    """
    if format not in FORMATS:
        raise DatasetError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    kind = detect_format(data) if format == "auto" else format
    if kind == "imagefolder":
        root = Path(data)
        folder = scan_folder(root, progress)
        return DatasetIndex("imagefolder", root, folder.classes, folder.labels, folder.paths)
    if kind == "list":
        path = Path(data)
        listed = scan_list(path, progress)
        return DatasetIndex("list", path.parent, (), listed.labels, listed.paths, metadata=listed.metadata)
    root, shards = list_shards(data)
    scanned = scan_shards(root, shards, progress)
    return DatasetIndex(
        "tar", root, (), scanned.labels, scanned.keys, tar=scanned.members, flaws=scanned.flaws
    )
