"""The files a format's ``--data`` names, wherever they are.

NOTE [ One storage ]
    A format says what its data looks like (a suffix, how a local folder is listed) and what to do
    with each file; it never asks where the files are. Given the data's ``Location`` (NOTE [ One
    location ]), ``list_files`` answers with a ``Listing``:
    local files under a root, or objects under a store's folder URL, behind one interface that
    names the files in order, stamps their present state for a saved index (size and mtime, or
    size and ETag: NOTE [ Saved indexes ]), gives each as a local file for a scan that reads it
    whole (a store's fetched, and kept in the cache folder if there is one: NOTE [ Fetch cache ]),
    or as a source read by range (a path, or the object itself), and records the versions a
    worker's reads must find. The readers' side of the same split is ``files.open_files``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectfolder import Suffix, store_object, store_objects
from loader_service.dataset.storage.patterns import expand_braces, is_brace_pattern
from loader_service.dataset.tables import DatasetError

Stamps = list[list[Any]] | None
"""Each file's name and present state, as JSON; None when a state cannot be told (an object
without an ETag), so that the index is not saved."""


class Listing(Protocol):
    @property
    def root(self) -> Path:
        """What local names are relative to; unused for a store's."""
        ...

    @property
    def url(self) -> str:
        """The store folder the names are relative to; "" for local files."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """The files, in the order their samples are numbered."""
        ...

    @property
    def folder(self) -> str:
        """Where the files are, as messages name it: a path, or a URL."""
        ...

    def stamps(self) -> Stamps: ...

    def where(self, name: str) -> str:
        """The file ``name`` as messages name it: a path, or a URL."""
        ...

    def size(self, name: str) -> int | None:
        """The file ``name``'s size in bytes; None if it cannot be looked at."""
        ...

    def versions(self) -> dict[str, tuple[int, str]]:
        """What a worker's read of each object must find: (size, ETag); empty for local files."""
        ...

    def local_copies(self) -> Generator[tuple[str, Path], None, None]:
        """Each file as a local one, in order (a store's fetched ahead; close the generator to drop
        what a failed scan fetched)."""
        ...

    def sources(self) -> Generator[tuple[str, Any], None, None]:
        """Each file as something a reader of ranges opens: a path, or the object itself."""
        ...

    def ranges(self) -> Generator[tuple[str, Any], None, None]:
        """Each file as ``sources`` gives it, but never fetched whole: a path, or the object read
        by range (a format that reads only an index at a file's end)."""
        ...


@dataclass(frozen=True)
class LocalListing:
    root: Path
    names: tuple[str, ...]
    url: str = ""

    def stamps(self) -> Stamps:
        return [[name, *_size_and_mtime(self.root / name)] for name in self.names]

    def where(self, name: str) -> str:
        return str(self.root / name)

    def size(self, name: str) -> int | None:
        return _size_and_mtime(self.root / name)[0]

    @property
    def folder(self) -> str:
        return str(self.root)

    def versions(self) -> dict[str, tuple[int, str]]:
        return {}

    def local_copies(self) -> Generator[tuple[str, Path], None, None]:
        yield from ((name, self.root / name) for name in self.names)

    def sources(self) -> Generator[tuple[str, Any], None, None]:
        yield from ((name, str(self.root / name)) for name in self.names)

    def ranges(self) -> Generator[tuple[str, Any], None, None]:
        return self.sources()


def _size_and_mtime(path: Path) -> tuple[int, int] | tuple[None, None]:
    """A file that cannot be looked at has no state: the stamps differ, and the scan says why."""
    try:
        info = os.stat(path)
    except OSError:
        return None, None
    return info.st_size, info.st_mtime_ns


def list_files(
    data: Location, suffix: Suffix, what: str, local: Callable[[Path], tuple[Path, tuple[str, ...]]]
) -> Listing:
    """The files ``data`` names: a store's ``suffix`` objects (one, a brace pattern of them, or
    those directly under a prefix), or what ``local`` lists on this host; ``what`` they are, for
    messages."""
    if data.in_store:
        return store_objects(data.text, data.storage, suffix, what)
    root, names = local(data.path)
    return LocalListing(root, names)


def list_file(data: Location, local: Callable[[Path], tuple[Path, tuple[str, ...]]]) -> Listing:
    """The one file ``data`` names: the store's object of that key, or what ``local`` checks on this
    host (a format whose data is a single file, such as a list)."""
    if data.in_store:
        return store_object(data.text, data.storage)
    root, names = local(data.path)
    return LocalListing(root, names)


def local_named(data: Path, matches: Suffix, what: str) -> tuple[Path, tuple[str, ...]]:
    """A format's local files and their root: the ``matches`` files of a folder (sorted by name), one
    file, or a brace pattern's; each must exist (``what`` they are, for messages)."""
    text = str(data)
    if os.path.isdir(text):
        with os.scandir(text) as it:
            found = sorted(e.name for e in it if e.is_file() and _matches(matches, e.name))
        if not found:
            raise DatasetError(f"no {what} in {text}")
        return Path(text), tuple(found)
    if is_brace_pattern(text) and not os.path.exists(text):
        paths = expand_braces(text)
        root = Path(os.path.commonpath([os.path.dirname(p) or "." for p in paths]))
        names: tuple[str, ...] = tuple(os.path.relpath(p, root) for p in paths)
    else:
        root, names = Path(text).parent, (Path(text).name,)
    for name in names:
        if not (root / name).is_file():
            raise DatasetError(f"{root / name} does not exist (of the {what} --data names)")
    return root, names


def _matches(matches: Suffix, name: str) -> bool:
    return matches(name) if callable(matches) else name.endswith(matches)
