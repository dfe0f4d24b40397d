"""A feed's sources: one index each, their samples numbered one after another (issue 38).

NOTE [ Sources of a feed ]
    A feed reads one or more named sources, each indexed as ``--data`` is (its own format, index
    and saved index). The feed numbers their samples one after another, in the order the sources
    are named: feed sample ``i`` is sample ``i - offsets[s]`` of source ``s``. Everything past the
    index (plans, slots, tasks, the indices row of a batch, the sample cache) speaks feed numbers;
    only reading a sample and naming it for a person split one into (source, sample). Labels stay
    each source's own: a source's classes are its own, and ``num_classes`` is the most any source
    has. A feed of one source numbers, names, labels and fingerprints its samples exactly as that
    source's index does, and saves it in the same files, so nothing a single-source feed saved,
    printed or checkpointed changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import numpy.typing as npt

from loader_service.dataset.format import Columns, Progress
from loader_service.dataset.index import DatasetIndex, load_or_build
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.tables import DatasetError, offsets_of

SOURCES_FILE = "sources.json"
"""Beside a feed's saved index: the sources' names, and the folder of each."""


@dataclass(frozen=True, eq=False)
class FeedSources:
    names: tuple[str, ...]
    indexes: tuple[DatasetIndex, ...]
    offsets: npt.NDArray[np.int64] = field(init=False)
    """``len(names) + 1`` values: where each source's samples begin, and the feed's size last."""

    def __post_init__(self) -> None:
        if not self.indexes or len(self.names) != len(self.indexes):
            raise DatasetError(f"a feed needs one index per source: {len(self.names)} names")
        object.__setattr__(self, "offsets", offsets_of([len(index) for index in self.indexes]))

    @classmethod
    def one(cls, name: str, index: DatasetIndex) -> FeedSources:
        return cls((name,), (index,))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def single(self) -> bool:
        return len(self.indexes) == 1

    def locate(self, i: int) -> tuple[int, int]:
        """(source, its sample) of feed sample ``i``."""
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return s, i - int(self.offsets[s])

    def split(self, samples: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(source, its sample) of each feed sample."""
        source = np.searchsorted(self.offsets, samples, side="right") - 1
        return source.astype(np.int64), samples - self.offsets[source]

    @cached_property
    def labels(self) -> npt.NDArray[np.int64]:
        """Each feed sample's label in its own source's classes (one source: its index's, mapped)."""
        if self.single:
            return self.indexes[0].labels
        return np.concatenate([index.labels for index in self.indexes]).astype(np.int64)

    @property
    def num_classes(self) -> int:
        return max(index.num_classes for index in self.indexes)

    @property
    def kind(self) -> str:
        """The format's name; for several sources, theirs joined by "+"."""
        return "+".join(index.kind for index in self.indexes)

    def relpath(self, i: int) -> str:
        """How feed sample ``i`` is named in logs and status: its source's name for it, after the
        source's own name where there are several."""
        s, j = self.locate(i)
        own = self.indexes[s].relpath(j)
        return own if self.single else f"{self.names[s]}:{own}"

    def path(self, i: int) -> Path:
        s, j = self.locate(i)
        return self.indexes[s].path(j)

    def fingerprint(self) -> str:
        """One source: its index's (a checkpoint of a single-source feed stays valid); several: of
        their names, order and fingerprints."""
        if self.single:
            return self.indexes[0].fingerprint()
        h = hashlib.sha256()
        for name, index in zip(self.names, self.indexes, strict=True):
            h.update(f"{name}\0{index.fingerprint()}\0".encode())
        return h.hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return sum(index.nbytes for index in self.indexes)

    def save(self, directory: Path) -> None:
        """One source in ``directory`` itself, as ``DatasetIndex.save`` writes it; several in a
        folder each; the names in ``SOURCES_FILE``."""
        folders = ["."] if self.single else [f"source{k}" for k in range(len(self.indexes))]
        for folder, index in zip(folders, self.indexes, strict=True):
            (directory / folder).mkdir(exist_ok=True)
            index.save(directory / folder)
        described = {"names": list(self.names), "folders": folders}
        (directory / SOURCES_FILE).write_text(json.dumps(described), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> FeedSources:
        """What ``save`` wrote, the arrays mapped read-only; a folder holding a plain saved index is
        one source named "data"."""
        described_at = directory / SOURCES_FILE
        if not described_at.exists():
            return cls.one("data", DatasetIndex.load(directory))
        described = json.loads(described_at.read_text(encoding="utf-8"))
        names: Sequence[str] = described["names"]
        indexes = tuple(DatasetIndex.load(directory / folder) for folder in described["folders"])
        return cls(tuple(names), indexes)


def index_sources(
    named: Sequence[tuple[str, str]],
    format: str,
    progress: Callable[[str], Progress | None],
    storage: StorageConfig,
    columns: Columns,
) -> FeedSources:
    """Each named source indexed as ``--data`` is, or its saved index taken (``load_or_build``);
    ``progress(name)`` reports a source's indexing. DatasetError naming the source that is wrong."""
    indexes = []
    for name, data in named:
        try:
            index = load_or_build(data, format, progress(name), storage, columns)
        except DatasetError as exc:
            raise DatasetError(f"source {name}: {exc}" if len(named) > 1 else str(exc)) from None
        if len(named) > 1 and len(index) == 0:
            raise DatasetError(f"source {name}: {data} holds no samples")
        indexes.append(index)
    return FeedSources(tuple(name for name, _ in named), tuple(indexes))
