"""The tar format (``dataset.format.Format``): WebDataset-style shards, indexed by ``scan`` and read
by ``reader``, local or in a store (``dataset.storage.listing``)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loader_service.dataset.format import (
    Columns,
    Format,
    Indexed,
    IndexPart,
    Mapped,
    Progress,
    Scanned,
)
from loader_service.dataset.formats.tar.reader import TarReader
from loader_service.dataset.formats.tar.scan import scan_files
from loader_service.dataset.formats.tar.shards import holds_shards, list_shards
from loader_service.dataset.storage.files import open_files
from loader_service.dataset.storage.listing import list_files
from loader_service.dataset.storage.location import Location
from loader_service.dataset.storage.objectstore import Heard
from loader_service.dataset.storage.patterns import COMPRESSED_SUFFIXES, TAR_SUFFIX, is_brace_pattern
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import (
    TarMembers,
)


class TarFormat:
    """``--format tar`` (``dataset.format.Format``)."""

    name = "tar"
    what = "a folder of .tar shards, one .tar file or a brace pattern of them"
    holds = ".tar files (shards?)"
    in_store = "folder"

    def claims_folder(self, root: Path) -> bool:
        return holds_shards(root)

    def claims_file(self, name: str) -> bool:
        return name.endswith((TAR_SUFFIX, *COMPRESSED_SUFFIXES))

    def claims_pattern(self, text: str) -> bool:
        return is_brace_pattern(text)

    def scan(self, data: Location, progress: Progress | None, columns: Columns) -> Scanned:
        listing = list_files(data, TAR_SUFFIX, "shards", list_shards)
        with contextlib.closing(listing.local_copies()) as copies:  # a failed scan's files go now
            found = scan_files(copies, listing.names, listing.folder, progress)
        flaws, url, versions = found.flaws, listing.url, listing.versions()
        return Scanned(listing.root, (), found.labels, found.keys, found.members, flaws, url, versions)

    def inputs(self, data: Location) -> Any:
        """Each shard's name, size and ETag (object store) or mtime (local disk)."""
        return list_files(data, TAR_SUFFIX, "shards", list_shards).stamps()

    def load_part(self, described: Mapping[str, Any], mapped: Mapped) -> IndexPart | None:
        facts = described["tar"]
        return TarMembers(
            shards=tuple(facts["shards"]),
            extensions=tuple(facts["extensions"]),
            sample_shard=mapped("sample_shard"),
            first_member=mapped("first_member"),
            member_offset=mapped("member_offset"),
            member_size=mapped("member_size"),
            member_extension=mapped("member_extension"),
        )

    def relpath(self, index: Indexed, i: int) -> str:
        return f"{_members(index).shards[int(_members(index).sample_shard[i])]}:{index.names.text(i)}"

    def path(self, index: Indexed, i: int) -> Path:
        return index.root / _members(index).shards[int(_members(index).sample_shard[i])]

    def reader(
        self, index: Indexed, max_bytes: int, storage: StorageConfig, heard: Heard | None
    ) -> TarReader:
        return TarReader(
            open_files(index, storage, max_bytes, heard), index.names, _members(index), max_bytes
        )


def _members(index: Indexed) -> TarMembers:
    assert isinstance(index.part, TarMembers), "a tar index holds its members"
    return index.part


FORMAT: Format = TarFormat()
