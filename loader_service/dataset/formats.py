"""The source formats, by ``--format`` name: the one registry that detection, the index, the
reader and the config's choices read from (each format is a ``dataset.source.Source``)."""

from __future__ import annotations

import os
from pathlib import Path

from loader_service.dataset import filelist, folder, tarshards
from loader_service.dataset.remote import is_remote
from loader_service.dataset.source import Source
from loader_service.dataset.tables import DatasetError

SOURCES: dict[str, Source] = {s.name: s for s in (folder.SOURCE, filelist.SOURCE, tarshards.SOURCE)}
FORMATS = ("auto", *SOURCES)
FOLDER_DEFAULT = folder.SOURCE.name
"""What a folder no format claims is taken for: its scan then says what it lacks."""


def source(name: str) -> Source:
    """The format called ``name``; DatasetError naming the ones there are."""
    found = SOURCES.get(name)
    if found is None:
        raise DatasetError(f"format must be one of {', '.join(FORMATS)}, not {name!r}")
    return found


def detect_format(data: str | Path) -> str:
    """The format ``data`` is, from what it is; DatasetError if that is unclear.

    A folder is claimed by the formats that recognise its contents (more than one is unclear; none:
    an ImageFolder); an existing file by its name; a path that does not exist by a pattern it is.
    """
    text = str(data)
    if is_remote(text):
        return _remote_format(text)
    if os.path.isdir(text):
        return _one_of([s for s in SOURCES.values() if s.claims_folder(Path(text))], text)
    if os.path.exists(text):
        name = text.lower()
        claimed = [s.name for s in SOURCES.values() if s.claims_file(name)]
        if claimed:
            return claimed[0]
        raise DatasetError(f"cannot tell the format of {text}: expected {_what()}; say which with --format")
    patterns = [s.name for s in SOURCES.values() if s.claims_pattern(text)]
    if patterns:
        return patterns[0]
    raise DatasetError(f"data {text} does not exist")


def _remote_format(url: str) -> str:
    """An object store URL's format: by the name or pattern it gives, else (a prefix) the format that
    reads a folder of objects."""
    readable = [s for s in SOURCES.values() if s.remote]
    for s in readable:
        if s.claims_file(url.lower()) or s.claims_pattern(url):
            return s.name
    folders = [s for s in readable if s.remote == "folder"]
    if len(folders) == 1:
        return folders[0].name
    flags = " or ".join(f"--format {s.name}" for s in folders)
    raise DatasetError(f"cannot tell the format of {url}: say which with {flags}")


def _one_of(claimed: list[Source], root: str) -> str:
    if len(claimed) > 1:
        what = " and ".join(s.holds for s in claimed)
        flags = " or ".join(f"--format {s.name}" for s in claimed)
        raise DatasetError(f"{root} holds both {what}; say which with {flags}")
    return claimed[0].name if claimed else FOLDER_DEFAULT


def _what() -> str:
    return "; ".join(f"{s.what} ({s.name})" for s in SOURCES.values())
