"""Which local tar shards a ``--data`` value names: a folder of ``*.tar``, one ``.tar`` file, or a
brace pattern of them (``dataset.storage.patterns``)."""

from __future__ import annotations

import os
from pathlib import Path

from loader_service.dataset.storage.patterns import (
    COMPRESSED_SUFFIXES,
    TAR_SUFFIX,
    expand_braces,
    is_brace_pattern,
)
from loader_service.dataset.tables import DatasetError


def list_shards(data: str | Path) -> tuple[Path, tuple[str, ...]]:
    """The root folder and the shard files relative to it, in the order their samples are numbered."""
    text = str(data)
    if os.path.isdir(text):
        return Path(text), _folder_shards(Path(text))
    if os.path.exists(text) or not is_brace_pattern(text):
        return Path(text).parent, (Path(text).name,)
    paths = expand_braces(text)
    root = os.path.commonpath([os.path.dirname(p) or "." for p in paths]) if paths else "."
    return Path(root), tuple(os.path.relpath(p, root) for p in paths)


def _folder_shards(root: Path) -> tuple[str, ...]:
    with os.scandir(root) as it:
        names = sorted(e.name for e in it if not e.name.startswith(".") and e.is_file())
    shards = tuple(n for n in names if n.endswith(TAR_SUFFIX))
    if shards:
        return shards
    compressed = [n for n in names if n.lower().endswith(COMPRESSED_SUFFIXES)]
    if compressed:
        raise DatasetError(
            f"{root} holds only compressed shards ({', '.join(compressed[:3])}...): dataferry reads "
            "members in place, so shards must be uncompressed .tar files (decompress them once)"
        )
    raise DatasetError(f"no .tar shards in {root}")


def holds_shards(root: Path) -> bool:
    with os.scandir(root) as it:
        return any(
            not e.name.startswith(".") and e.name.lower().endswith((TAR_SUFFIX, *COMPRESSED_SUFFIXES))
            for e in it
        )
