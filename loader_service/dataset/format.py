"""What a data format is: the small protocol each format module implements (``dataset.formats``
registers them).

A format recognises a ``--data`` value, scans it into the parts of an index every format shares
(labels, names, flaws) plus a part of its own (``IndexPart``: arrays the decode workers map, and what
JSON says of them), and opens a reader that returns a sample's image bytes and metadata. Adding a
format is one module defining a ``Format`` and one entry in ``formats.FORMATS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy.typing as npt

from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import I64, StringTable

Progress = Callable[[int], None]
"""Called with the number of samples found so far, every 10,000 or so."""
Mapped = Callable[[str], npt.NDArray[Any]]
"""A saved array of the index, by name, mapped read-only (``DatasetIndex.load``)."""
Metadata = dict[str, Callable[[], object]]
"""A sample's metadata items by name, each read when called."""


class IndexPart(Protocol):
    """A format's own part of the index."""

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """What the index saves as ``NAME.npy`` and workers map; names unique across formats."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able facts about the arrays, under a key of the format's own (the index's
        fingerprint covers it)."""
        ...


@dataclass(frozen=True)
class Columns:
    """``--image-column`` and ``--label-column``: where a table format (Parquet, a ``save_to_disk``
    folder) keeps a sample's image and label, or which features of a TFRecord Example hold them;
    other formats have no columns to choose."""

    image: str = ""
    """"": the column ``datasets`` marks as an ``Image``, else ``image``."""
    label: str = "label"
    """A missing label column gives every sample -1."""
    label_offset: int = 0
    """``--label-offset``: subtracted from each TFRecord label (a label below 0 is none: -1)."""


class Scanned(NamedTuple):
    """What a scan found, in the data's own order."""

    root: Path
    """What the names are relative to."""
    classes: tuple[str, ...]
    labels: I64
    names: StringTable
    part: IndexPart | None = None
    flaws: Mapping[int, str] = {}
    url: str = ""
    """The object store folder the names are relative to (``root`` is then unused); "" for local data."""
    versions: Mapping[str, tuple[int, str]] = {}
    """Objects in a store the reader reads by range, by name: (size, ETag) as indexed."""


class Indexed(Protocol):
    """What a format reads back of the index its scan made (``dataset.index.DatasetIndex`` is one):
    the index is built from the formats, so they know it by this much only."""

    @property
    def root(self) -> Path: ...

    @property
    def names(self) -> StringTable: ...

    @property
    def part(self) -> IndexPart | None: ...

    @property
    def url(self) -> str: ...

    @property
    def versions(self) -> Mapping[str, tuple[int, str]]: ...


class Reader(Protocol):
    """Reads samples' bytes in a decode worker; ``DecodeError`` (its text the reason) for a bad one."""

    def image_bytes(self, i: int) -> bytes: ...

    def metadata(self, i: int) -> Metadata: ...

    def prefetch(self, indices: Sequence[int]) -> None:
        """The samples whose images are about to be read (NOTE [ Object store reads ])."""
        ...

    def close(self) -> None: ...


class Format(Protocol):
    name: str
    """The ``--format`` value."""
    what: str
    """What ``--data`` is for this format, for messages: "a folder of class sub-folders"."""
    holds: str
    """What a folder of this format holds, for the message when several formats claim one."""

    def claims_folder(self, root: Path) -> bool:
        """Is the existing folder ``root`` data of this format?"""
        ...

    def claims_file(self, name: str) -> bool:
        """Is an existing file of this (lower-case) name data of this format?"""
        ...

    def claims_pattern(self, text: str) -> bool:
        """Is ``text``, no existing path, a pattern naming data of this format?"""
        ...

    @property
    def in_store(self) -> str:
        """What of an object store ``--data`` may name: "" nothing, "files" objects by name or
        pattern, "folder" a prefix holding them too."""
        ...

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        """Index the data once; ``DatasetError`` naming what is wrong. ``data`` is in a store only
        if ``in_store`` says this format may read one (NOTE [ One location ])."""
        ...

    def inputs(self, data: Location) -> Any:
        """What identifies the data's present state, cheaply taken (sizes and mtimes, ETags), as JSON:
        an equal value lets a saved index be used instead of a scan (NOTE [ Saved indexes ]); None if
        the state cannot be told (an object without an ETag), so the index is not saved."""
        ...

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        """The part ``IndexPart.describe`` and ``arrays`` saved, back from the index's description."""
        ...

    def relpath(self, index: Indexed, i: int) -> str:
        """How sample ``i`` is named in logs, status and ``loader-service index``."""
        ...

    def path(self, index: Indexed, i: int) -> Path:
        """The file that holds sample ``i``."""
        ...

    def reader(self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None) -> Reader:
        """A reader of ``index``'s samples, refusing any over ``max_bytes``; ``heard`` is told of each
        answer of a store to its reads (``files.open_files``)."""
        ...
