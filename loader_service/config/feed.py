"""The options that describe one feed (NOTE in ``options``: at the top level they configure the first
feed; each ``[feeds.NAME]`` table adds one), and what makes a feed's values whole."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loader_service.config import checks
from loader_service.config.checks import at_least, between
from loader_service.config.option import option
from loader_service.config.values import ByteSize, require
from loader_service.dataset.formats import FORMATS
from loader_service.dataset.index import FORMAT_CHOICES
from loader_service.dataset.storage.location import Location
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import antialias_problem
from protocol.layout import MAX_ENCODED, FieldSpec
from protocol.messages import MAX_SOURCES

AUGMENTS = ("train", "eval", "none")
FIRST_SLOTS = 8
"""Slots an automatic pool reserves at start: the warm start's 2 batches and one trainer's default 6
credits. It grows by what its trainers hold (NOTE [ A pool as large as what is in flight ] in
loader_service/supervisor/slots.py)."""
AUTO_MOST_SLOTS = 256
"""Slots an automatic pool may grow to at least: its trainers' credits, not its workers, say how
many it needs (8 DDP ranks of 6 credits hold 48; a pool of 12 for 2 workers let the first two
ranks take every slot while the others waited for one). Address space until a trainer holds them;
/dev/shm stops the growth before that if it is smaller."""
AUTO_ENCODED_ROW_BYTES = 64 * 1024
"""The least room ``-1`` gives a row: a small output size still leaves room for a photo's JPEG."""


@dataclass(frozen=True, kw_only=True)
class FeedOptions:
    """The options of one feed: the top-level ones make the first feed, ``[feeds.NAME]`` tables others."""

    data: str = field(
        default="",
        metadata=option(
            "the dataset: an ImageFolder root, a .csv or .jsonl list, a folder of .tar or .parquet "
            "files, one such file or a brace pattern such as shards/train-{000000..000127}.tar (see "
            "--format); all but an ImageFolder may be in an object store: s3://bucket/shards/, gs://, "
            "az://. Required, unless --source names several sources instead",
            check=checks.data_source,
        ),
    )
    format: str = field(
        default="auto",
        metadata=option(
            "what --data holds: "
            + "; ".join(f"{f.name}, {f.what}" for f in FORMATS.values())
            + "; or auto (told by --data)",
            choices=FORMAT_CHOICES,
        ),
    )
    image_column: str = field(
        default="",
        metadata=option(
            "Parquet: the column holding each image (a struct of bytes and path, as datasets' Image "
            "feature writes, or binary); default: the column datasets marks as an Image, else image"
        ),
    )
    label_column: str = field(
        default="label",
        metadata=option(
            "Parquet and save_to_disk: the column holding each label (an integer); TFRecord: the int64 "
            "feature (left at label: image/class/label, unless the Example has a label); absent: every "
            "label is -1"
        ),
    )
    label_offset: int = field(
        default=0,
        metadata=option(
            "TFRecord: subtracted from every label (1 for TensorFlow's Inception-era ImageNet files, whose "
            "labels 1..1000 keep 0 for the background); a label below 0 is none (-1)",
            check=checks.at_least(0),
        ),
    )
    pipeline: str = field(
        default="",
        metadata=option(
            "FILE.py:FUNC or package.module:FUNC, called as FUNC(sample, rng) on every sample in the "
            "decode workers instead of --augment; the fields it returns make the batch",
            check=checks.pipeline,
        ),
    )
    batch_size: int = field(default=64, metadata=option("images per batch", check=between(1, 4096)))
    image_size: int = field(
        default=224,
        metadata=option("output side S in pixels: batches are 3 x S x S uint8", check=between(8, 2048)),
    )
    augment: str = field(
        default="train",
        metadata=option(
            "train (RandomResizedCrop + flip), eval (resize + center crop) or none (resize)", choices=AUGMENTS
        ),
    )
    interpolation: str = field(
        default=INTERPOLATIONS[0],
        metadata=option(
            "the built-in transforms' resize filter: bilinear-antialias (torchvision's default), "
            "bilinear (OpenCV's INTER_LINEAR, as a plain cv2.resize) or area (OpenCV's INTER_AREA)",
            choices=INTERPOLATIONS,
        ),
    )
    encoded_row_bytes: int = field(
        default=-1,
        metadata=option(
            "room in every slot for rows a trainer decodes itself (ServiceLoader(decode=...)), in bytes "
            f"a row on average: -1 (auto): max(3 x S x S, {AUTO_ENCODED_ROW_BYTES // 1024} KiB) where "
            "the built-in train or eval transform runs with the region decoder, else none; 0: offer "
            "no encoded rows",
            check=between(-1, MAX_ENCODED, "-1 (auto)"),
        ),
    )
    seed: int = field(
        default=0,
        metadata=option("seeds the epoch permutations and all augmentation randomness", check=checks.seed),
    )
    slots: int = field(
        default=0,
        metadata=option(
            "batches in the shared-memory pool, all reserved at start; 0 (auto): reserve "
            f"{FIRST_SLOTS} and grow to what the trainers hold (up to {AUTO_MOST_SLOTS}, or 2 x the "
            "most workers + 8)",
            check=between(0, 4096, "0 (auto)"),
        ),
    )
    cache_memory: ByteSize = field(
        default=ByteSize(0),
        metadata=option(
            "bytes of shared memory that keep this feed's decoded samples for later epochs (64G, 512M; "
            "0: off): eval, none and a deterministic pipeline keep finished samples, train and other "
            "pipelines the decoded images",
            check=at_least(0),
        ),
    )
    pipeline_deterministic: bool = field(
        default=False,
        metadata=option(
            "the pipeline gives the same output for a sample in every epoch, so its cache keeps "
            "finished samples (checked on sample 0 at start)"
        ),
    )
    fields: tuple[FieldSpec, ...] = ()
    """The batch a pipeline must return, from a ``[fields]`` or ``[feeds.NAME.fields]`` table of the
    config file (not a flag); empty: inferred from the pipeline's output on sample 0."""
    sources: tuple[tuple[str, str], ...] = ()
    """Named sources read as one feed (NOTE [ Sources of a feed ]): ``--source NAME=DATA`` flags, or
    a ``[sources]`` or ``[feeds.NAME.sources]`` table of ``NAME = DATA``; each DATA anything
    ``data`` takes. Empty: ``data`` is the feed's one source."""

    @property
    def named_sources(self) -> tuple[tuple[str, str], ...]:
        """(name, data) of every source the feed reads: ``data`` alone is one source named "data"."""
        return self.sources or (("data", self.data),)


SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_data(config: FeedOptions, where: str) -> tuple[tuple[str, str], ...]:
    """The feed's sources, each checked as ``data`` is and made absolute (NOTE [ Sources of a
    feed ]); ConfigError naming what is wrong: neither data nor sources, both, a name twice."""
    if not config.sources:
        require(
            bool(config.data),
            where + "data is required (flag --data, variable DATAFERRY_DATA or key 'data' in the config "
            "file), or several named sources (--source NAME=DATA)",
            key="data",
        )
        return ()
    require(not config.data, where + "give data or sources (--source NAME=DATA), not both", key="data")
    require(len(config.sources) <= MAX_SOURCES, where + f"at most {MAX_SOURCES} sources in a feed")
    names = [name for name, _ in config.sources]
    twice = sorted({name for name in names if names.count(name) > 1})
    require(not twice, where + f"source names must be unique: {', '.join(twice)} given twice")
    for name, data in config.sources:
        require(
            SOURCE_NAME.fullmatch(name) is not None,
            where + f"source name {name!r} must be 1 to 64 letters, digits, '_', '-' or '.'",
        )
        problem = checks.data_source(f"source {name}:", data)
        require(problem is None, where + (problem or ""))
    return tuple((name, resolve_data(data)) for name, data in config.sources)


def parse_sources(texts: Sequence[str], what: str) -> tuple[tuple[str, str], ...]:
    """``NAME=DATA`` texts (``--source`` flags) as (name, data) pairs."""
    pairs = []
    for text in texts:
        name, sep, data = text.partition("=")
        require(bool(sep) and bool(name.strip()) and bool(data), f"{what} needs NAME=DATA, not {text!r}")
        pairs.append((name.strip(), data))
    return tuple(pairs)


def resolve_data(data: str | Path) -> str:
    """A local path made absolute (workers need not share our cwd); an object store URL as given
    (NOTE [ One location ])."""
    return Location.of(data).absolute().text


def absolute_path(path: str | Path) -> str:
    """A path on this host made absolute: workers need not share our cwd."""
    return str(Path(path).expanduser().resolve())


def resolve_pipeline(spec: str) -> str:
    """A FILE.py:FUNC pipeline with its file made absolute: workers need not share our cwd."""
    module, _, func = spec.rpartition(":")
    return f"{absolute_path(module)}:{func}" if module.endswith(".py") else spec


def check_fields(config: FeedOptions, where: str) -> None:
    require(
        not config.pipeline_deterministic or bool(config.pipeline),
        where + "pipeline_deterministic describes a pipeline: give pipeline too "
        "(the built-in transforms' caches already keep what each can)",
    )
    require(
        not config.fields or bool(config.pipeline),
        where + "a [fields] table states what a pipeline returns: give pipeline too "
        "(the built-in transforms always give image and label)",
    )
    if not config.pipeline and config.interpolation == "bilinear-antialias":
        problem = antialias_problem()
        require(problem is None, where + (problem or ""))
