"""The dataset index: which bytes are sample ``i``, and its label, held in a few compact numpy arrays.

Every data format (``--format``: ``dataset.formats``) gives a sample an index (its position: the
order is fixed by the source), a label (-1 when the source has none), a name, and whatever the
format itself needs to find the sample's bytes (its ``IndexPart``: a list's other columns, a tar
shard's member offsets). Adding a format adds a part, not a field here.

The service builds the index once at start and saves it (``save``); every decode worker maps the arrays
read-only (``load``), so the page cache holds one copy for all of them. Reading a sample's bytes is
``loader_service.decode.reading.SampleReader``'s job, through the format's reader.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.format import Columns, IndexPart, Progress
from loader_service.dataset.formats import FORMAT_CHOICES, detect_format, format_named
from loader_service.dataset.formats.folder import EXTENSIONS
from loader_service.dataset.storage.cachedir import FetchCache, index_key
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import I64, DatasetError, StringTable

__all__ = [
    "EXTENSIONS",
    "FORMAT_CHOICES",
    "DatasetError",
    "DatasetIndex",
    "build_index",
    "detect_format",
]

log = logging.getLogger(__name__)

LOCAL = StorageConfig()
"""Local data, no cache folder."""
ANY_COLUMNS = Columns()
"""The default image and label columns."""
_SAVED_VERSION = 1
PART_KEYS = ("metadata", "tar")
"""The keys the parts of the first formats describe themselves under. Every index's description
holds them (None where absent), as it did before formats had parts: the fingerprints of saved
trainer states stay valid."""


@dataclass(frozen=True)
class DatasetIndex:
    kind: str
    """The format's name (``formats.FORMATS``)."""
    root: Path
    """The ImageFolder, the list file's folder, or the folder the shards are named relative to."""
    classes: tuple[str, ...]
    """ImageFolder's class names (label = position); () for list and tar."""
    labels: I64
    names: StringTable
    """Per sample: the path relative to ``root`` (imagefolder, list), or the key in its shard (tar)."""
    part: IndexPart | None = None
    """What the format keeps of its own (``dataset.format.IndexPart``), if anything."""
    flaws: Mapping[int, str] = field(default_factory=dict)
    """Samples found unreadable while indexing (tar: a damaged header, a bad ``.cls``), and why."""
    url: str = ""
    """The object store folder names are relative to, for data in a store (``root`` is then unused)."""
    versions: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    """Objects in a store read by range (tar shards), by name: their (size, ETag) when indexed."""

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> str:
        """How sample ``i`` is named in logs, status and ``loader-service index``; ``shard:key`` for tar."""
        return format_named(self.kind).relpath(self, i)

    def path(self, i: int) -> Path:
        """The image file (imagefolder, list), or the shard file that holds the sample (tar)."""
        return format_named(self.kind).path(self, i)

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
        # Not where the data is (it may move, to or from a store) nor the saved-format version: the
        # same data, the same print.
        described = {k: v for k, v in self._description().items() if k not in ("root", "version", "storage")}
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

        return cls(
            kind=desc["kind"],
            root=Path(desc["root"]),
            classes=tuple(desc["classes"]),
            labels=mapped("labels"),
            names=StringTable(mapped("name_offsets"), mapped("name_blob")),
            part=format_named(desc["kind"]).load_part(desc, mapped),
            flaws={int(k): v for k, v in desc["flaws"].items()},
            url=desc.get("storage", {}).get("url", ""),
            versions={
                k: (int(v[0]), str(v[1])) for k, v in desc.get("storage", {}).get("versions", {}).items()
            },
        )

    def _arrays(self) -> dict[str, npt.NDArray[Any]]:
        arrays: dict[str, npt.NDArray[Any]] = {
            "labels": self.labels,
            "name_offsets": self.names.offsets,
            "name_blob": self.names.blob,
        }
        if self.part is not None:
            arrays.update(self.part.arrays)
        return arrays

    def _description(self) -> dict[str, Any]:
        """Everything but the arrays, as JSON."""
        return {
            "version": _SAVED_VERSION,
            "kind": self.kind,
            "root": os.path.abspath(self.root),  # workers need not share the service's working folder
            "classes": list(self.classes),
            **dict.fromkeys(PART_KEYS),
            **(self.part.describe() if self.part is not None else {}),
            "flaws": {str(k): v for k, v in sorted(self.flaws.items())},
            # Only for data in a store: local indexes keep their descriptions (and fingerprints).
            **({"storage": {"url": self.url, "versions": self.versions}} if self.url else {}),
        }


def _raw(arr: npt.NDArray[Any]) -> memoryview:
    # The bytes without a copy: a copy of a large index would stay in the service's heap.
    return np.ascontiguousarray(arr).data.cast("B")


def build_index(
    data: str | Path | Location,
    format: str = "auto",
    progress: Progress | None = None,
    storage: StorageConfig | None = None,
    columns: Columns = ANY_COLUMNS,
) -> DatasetIndex:
    """Index ``data`` once. ``progress(found_so_far)`` is called every 10,000 samples.

    ``data``: an ImageFolder, a folder of ``*.tar`` shards, a ``.csv`` or ``.jsonl`` file, a ``.tar``
    file, or a brace pattern such as ``dir/train-{000000..000127}.tar`` (``formats.FORMATS``); the
    same in an object store (``s3://bucket/shards/``), but an ImageFolder.
    """
    where = Location.of(data, storage)  # NOTE [ One location ]
    kind = resolve_format(where, format)
    found = format_named(kind).scan(where, progress, columns)
    return DatasetIndex(
        kind,
        found.root,
        found.classes,
        found.labels,
        found.names,
        found.part,
        found.flaws,
        found.url,
        dict(found.versions),
    )


def resolve_format(data: str | Path | Location, format: str, storage: StorageConfig | None = None) -> str:
    """The format ``--format`` names, or the one ``data`` is (``auto``); DatasetError for a format
    that cannot read from where ``data`` is."""
    if format not in FORMAT_CHOICES:
        raise DatasetError(f"format must be one of {', '.join(FORMAT_CHOICES)}, not {format!r}")
    where = Location.of(data, storage)
    if format == "auto":
        return detect_format(where)
    if where.in_store and not format_named(format).in_store:
        raise DatasetError(f"{where}: format {format} cannot be read from an object store")
    return format


def load_or_build(
    data: str | Path | Location,
    format: str,
    progress: Progress | None,
    storage: StorageConfig,
    columns: Columns = ANY_COLUMNS,
) -> DatasetIndex:
    """The index saved in the cache folder for ``data`` as it is now, else ``build_index``'s, saved
    there for the next start (NOTE [ Saved indexes ]). No cache folder: ``build_index``."""
    data = Location.of(data, storage)  # NOTE [ One location ]
    if not storage.cache_dir:
        return build_index(data, format, progress, storage, columns)
    kind = resolve_format(data, format)
    inputs = format_named(kind).inputs(data)
    if inputs is None:  # nothing to tell a change by (an object without an ETag): scan every start
        return build_index(data, kind, progress, storage, columns)
    cache = FetchCache(storage.cache_dir, storage.cache_size)
    key = index_key(
        kind,
        str(data),
        [columns.image, columns.label, *([columns.label_offset] if columns.label_offset else [])],
    )
    folder = cache.saved_index(key, inputs)
    if folder is not None:
        try:
            index = DatasetIndex.load(folder)
        except (OSError, ValueError, KeyError, DatasetError) as exc:  # damaged: index anew
            log.warning("the saved index of %s cannot be read (%s); indexing again", data, exc)
        else:
            log.info("%s: the saved index of %d samples is current; not indexing again", data, len(index))
            return index
    index = build_index(data, kind, progress, storage, columns)
    if not cache.save_index(key, inputs, index.save):
        log.warning("%s: no room in --cache-size for its index; it will be indexed again next start", data)
    return index
