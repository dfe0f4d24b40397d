"""The data formats, by ``--format`` name: the one registry that detection, the index, the
reader and the config's choices read from (each format is a ``dataset.format.Format``)."""

from __future__ import annotations

import os
from pathlib import Path

from loader_service.dataset.format import Format
from loader_service.dataset.formats import filelist, folder
from loader_service.dataset.formats.arrow import format as arrow_format
from loader_service.dataset.formats.parquet import format as parquet_format
from loader_service.dataset.formats.tar import format as tar_format
from loader_service.dataset.formats.tfrecord import format as tfrecord_format
from loader_service.dataset.formats.zip import format as zip_format
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import SCAN_DEADLINE, Bucket
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.urls import split_url
from loader_service.dataset.tables import DatasetError

FORMATS: dict[str, Format] = {
    # Parquet and TFRecord before tar: a brace pattern is tar's unless it names their files.
    s.name: s
    for s in (
        folder.FORMAT,
        filelist.FORMAT,
        parquet_format.FORMAT,
        tfrecord_format.FORMAT,
        tar_format.FORMAT,
        zip_format.FORMAT,
        arrow_format.FORMAT,
    )
}
FORMAT_CHOICES = ("auto", *FORMATS)
FOLDER_DEFAULT = folder.FORMAT.name
"""What a folder no format claims is taken for: its scan then says what it lacks."""


def format_named(name: str) -> Format:
    """The format called ``name``; DatasetError naming the ones there are."""
    found = FORMATS.get(name)
    if found is None:
        raise DatasetError(f"format must be one of {', '.join(FORMAT_CHOICES)}, not {name!r}")
    return found


def detect_format(data: str | Path | Location) -> str:
    """The format ``data`` is, from what it is; DatasetError if that is unclear.

    A folder is claimed by the formats that recognise its contents (more than one is unclear; none:
    an ImageFolder); an existing file by its name; a path that does not exist by a pattern it is; a
    store's URL by the name it gives, else by the objects under it.
    """
    where = Location.of(data)
    if where.in_store:
        return _store_format(where.text, where.storage)
    text = where.text
    if os.path.isdir(text):
        return _one_of([s for s in FORMATS.values() if s.claims_folder(Path(text))], text)
    if os.path.exists(text):
        name = text.lower()
        claimed = [s.name for s in FORMATS.values() if s.claims_file(name)]
        if claimed:
            return claimed[0]
        raise DatasetError(f"cannot tell the format of {text}: expected {_what()}; say which with --format")
    patterns = [s.name for s in FORMATS.values() if s.claims_pattern(text)]
    if patterns:
        return patterns[0]
    raise DatasetError(f"data {text} does not exist")


def _store_format(url: str, storage: StorageConfig) -> str:
    """An object store URL's format: by the name or pattern it gives, else (a prefix) by the names of
    the objects directly under it, as a local folder's files tell."""
    readable = [s for s in FORMATS.values() if s.in_store]
    for s in readable:
        if s.claims_pattern(url) or s.claims_file(url.lower()):
            return s.name
    folders = [s for s in readable if s.in_store == "folder"]
    prefix = split_url(url)[1].strip("/")
    prefix = f"{prefix}/" if prefix else ""
    names = [o.key[len(prefix) :].lower() for o in Bucket(url, storage, SCAN_DEADLINE).list(prefix)]
    claimed = [s for s in folders if any("/" not in n and s.claims_file(n) for n in names)]
    if len(claimed) == 1:
        return claimed[0].name
    what = (
        " and ".join(s.holds for s in claimed)
        if claimed
        else "none of " + ", ".join(s.holds for s in folders)
    )
    flags = " or ".join(f"--format {s.name}" for s in claimed or folders)
    raise DatasetError(f"{url} holds {what}; say which with {flags}")


def _one_of(claimed: list[Format], root: str) -> str:
    if len(claimed) > 1:
        what = " and ".join(s.holds for s in claimed)
        flags = " or ".join(f"--format {s.name}" for s in claimed)
        raise DatasetError(f"{root} holds both {what}; say which with {flags}")
    return claimed[0].name if claimed else FOLDER_DEFAULT


def _what() -> str:
    return "; ".join(f"{s.what} ({s.name})" for s in FORMATS.values())
