"""What a pipeline is handed for one sample: a read-only mapping whose items (the image's bytes, its
label, metadata) are read when first asked for (NOTE [ Pipeline determinism ] in ``pipeline``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import cv2
import numpy as np
import numpy.typing as npt

from loader_service.dataset.index import DatasetIndex
from loader_service.dataset.sources import FeedSources
from loader_service.decode.cache import SampleCache
from loader_service.decode.reading import FeedReader, SampleReader
from protocol.pixels.render import decode_bytes

Pipeline = Callable[["Sample", np.random.Generator], object]
"""What ``--pipeline`` names: ``FUNC(sample, rng) -> {name: array or tensor}``."""


RESERVED = ("image", "bytes", "label", "index", "epoch", "path")
"""The keys every sample has; a metadata column or member of the same name is hidden by them."""


class Sample(Mapping[str, Any]):
    """One sample as a pipeline sees it: a read-only mapping whose values load on first access.

    ``image`` (RGB HWC uint8, EXIF orientation applied, the pixel limit enforced: ``decode_bytes``),
    ``bytes`` (the raw image file), ``label`` (int, -1 without one), ``index``, ``epoch``, ``path``
    (``FeedSources.relpath``), then the sample's metadata by name. ``"image" in sample`` and
    iterating the keys load nothing; a pipeline that never reads ``image`` never decodes. With a
    ``cache`` of decoded images (NOTE [ Sample cache ]), ``image`` is a copy of the cached one, or is
    stored there once decoded.
    """

    def __init__(
        self,
        reader: SampleReader | FeedReader,
        index: DatasetIndex | FeedSources,
        i: int,
        epoch: int,
        cache: SampleCache | None = None,
    ) -> None:
        self._reader = reader
        self._cache = cache
        self._index = index
        self._i = i
        self._epoch = epoch
        self._loaded: dict[str, Any] = {}
        self._metadata: dict[str, Callable[[], object]] | None = None
        self.hidden: tuple[str, ...] = ()
        """Metadata names hidden by a reserved key, once the metadata has been listed."""

    def check(self) -> None:
        """DecodeError if the sample was found damaged when the index was built (a tar sample
        without an image member, say): it is bad whatever the pipeline would read."""
        self._listed()

    def __getitem__(self, key: str) -> Any:
        if key not in self._loaded:
            self._loaded[key] = self._load(key)
        return self._loaded[key]

    def __contains__(self, key: object) -> bool:
        return key in RESERVED or key in self._listed()

    def __iter__(self) -> Iterator[str]:
        yield from RESERVED
        yield from (k for k in self._listed() if k not in RESERVED)

    def __len__(self) -> int:
        return len(RESERVED) + sum(1 for k in self._listed() if k not in RESERVED)

    def __repr__(self) -> str:
        return f"<Sample {self._i} of epoch {self._epoch}: {', '.join(self)}>"

    def _load(self, key: str) -> Any:
        if key == "image":
            return self._image()
        if key == "bytes":
            return self._reader.image_bytes(self._i)
        if key == "label":
            return int(self._index.labels[self._i])
        if key == "index":
            return self._i
        if key == "epoch":
            return self._epoch
        if key == "path":
            return self._index.relpath(self._i)
        loader = self._listed().get(key) if isinstance(key, str) else None
        if loader is None:
            raise KeyError(key)
        return loader()

    def _image(self) -> npt.NDArray[np.uint8]:
        cache = self._cache
        if cache is not None and (cached := cache.image(self._i)) is not None:
            return cached.copy()  # the pipeline's own: it may write into it
        image = cast(npt.NDArray[np.uint8], cv2.cvtColor(decode_bytes(self["bytes"]), cv2.COLOR_BGR2RGB))
        if cache is not None and cache.admitting:
            cache.store(self._i, [image], image.shape[0], image.shape[1])
        return image

    def _listed(self) -> dict[str, Callable[[], object]]:
        if self._metadata is None:
            self._metadata = self._reader.metadata(self._i)
            self.hidden = tuple(k for k in self._metadata if k in RESERVED)
        return self._metadata
