"""The service's one typed configuration: defaults, a TOML file, the environment and flags land here.

Each option is declared once, as a field of the classes below whose metadata holds its help text,
choices and check: ``field(default=64, metadata=option("images per batch", check=...))``. From that
one declaration follow:

- the flag ``--batch-size`` (``tools/cli.py`` builds the parser from ``OPTIONS``),
- the TOML key ``batch_size = 64`` of the ``--config`` file,
- the environment variable ``DATAFERRY_BATCH_SIZE=64``, read as the option's type,
- the check that runs once, in ``validated()``, whichever layer the value came from.

Precedence: built-in defaults < TOML file < environment < flags. Unknown keys in the file are an
error, so a typo is caught at start-up instead of silently falling back to a default; environment
variables that name no option (``DATAFERRY_INJECT_FAULT``, say) are not read at all.

The options of ``FeedOptions`` describe one feed. At the top level they configure the first feed;
each ``[feeds.NAME]`` table of the file adds a feed with exactly those keys, inheriting the top-level
values it does not set (except ``slots``: each feed's pool is sized on its own).
"""

from __future__ import annotations

import functools
import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from loader_service.config import checks
from loader_service.config.checks import Check, at_least, between, positive
from loader_service.config.cpus import Budget, cpu_budget
from loader_service.dataset.index import FORMATS, LOCAL
from loader_service.dataset.storage.local import DEFAULT_MAX_FILE_BYTES
from loader_service.dataset.storage.objectstore import StorageConfig, is_remote
from loader_service.decode.decoders import DECODERS, uses_roi
from loader_service.decode.geometry import INTERPOLATIONS
from protocol.layout import FieldSpec

AUGMENTS = ("train", "eval", "none")
ENV_PREFIX = "DATAFERRY_"
EXTRA_FEED_SLOTS = 10
"""Pool size of a ``[feeds.NAME]`` feed whose ``slots`` is 0 (auto)."""


class ByteSize(int):
    """A number of bytes, given as an integer or with a binary suffix: ``64G``, ``512M``, ``1.5T``."""

    def __new__(cls, value: int | str = 0) -> ByteSize:
        if isinstance(value, str):
            return super().__new__(cls, parse_bytes(value))
        return super().__new__(cls, value)


ByteSize.__name__ = "size"  # what argparse names in "invalid size value: '12Q'"


class WorkerCount(int):
    """A number of decode workers, or ``auto`` (0): sized by the service (NOTE [ Sizing workers ])."""

    def __new__(cls, value: int | str = 0) -> WorkerCount:
        if isinstance(value, str):
            text = value.strip().lower()
            return super().__new__(cls, 0 if text == "auto" else int(text))
        return super().__new__(cls, value)

    def __str__(self) -> str:
        return "auto" if self == 0 else int.__str__(self)


WorkerCount.__name__ = "count"  # argparse: "invalid count value: 'many'"
AUTO_MAX_WORKERS_PER_CORE = 4
"""``--workers auto`` starts this many workers per core of the budget (at least ``MIN_AUTO_WORKERS``,
at most ``MAX_AUTO_WORKERS``): a feed whose workers wait on a store or in a pipeline may use more
workers than cores. A parked worker costs its memory (OpenCV and numpy loaded), no CPU."""
MIN_AUTO_WORKERS = 4
MAX_AUTO_WORKERS = 256
_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])(?:I?B)?|B)?")
MAX_BYTES = 2**62


def parse_bytes(text: str) -> int:
    """``64G`` -> 68719476736: K, M, G, T are powers of 1024, optionally followed by ``B`` or ``iB``;
    a fraction must come to whole bytes (``1.5G`` does, ``0.5`` does not). ValueError otherwise."""
    match = _SIZE.fullmatch(text.strip().upper())
    value = float(match[1]) * _SUFFIXES[match[2] or ""] if match else -1.0
    if not (0 <= value < MAX_BYTES and value.is_integer()):
        raise ValueError(f"{text!r} is not a size such as 64G, 512M or 1000000 (bytes)")
    return int(value)


class ConfigError(ValueError):
    """A configuration value that the service cannot run with; the message says which and why."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        # The top-level option at fault, if it is one: load_config then adds which layer set it.
        self.key = key


# --- the declaration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    help: str
    choices: tuple[str, ...]
    check: Check | None


def option(help: str, *, choices: tuple[str, ...] = (), check: Check | None = None) -> dict[str, _Spec]:
    """Field metadata making a config field an option: a flag, a TOML key and an environment variable."""
    return {"option": _Spec(help, choices, check)}


@dataclass(frozen=True, kw_only=True)
class FeedOptions:
    """The options of one feed: the top-level ones make the first feed, ``[feeds.NAME]`` tables others."""

    data: str = field(
        metadata=option(
            "the dataset: an ImageFolder root, a .csv or .jsonl list, a folder of .tar or .parquet "
            "files, one such file or a brace pattern such as shards/train-{000000..000127}.tar (see "
            "--format); all but an ImageFolder may be in an object store: s3://bucket/shards/, gs://, az://",
            check=checks.data_source,
        )
    )
    format: str = field(
        default="auto",
        metadata=option(
            "what --data holds: imagefolder (one sub-folder per class), list (.csv or .jsonl: path, "
            "label, metadata), tar (WebDataset-style shards), parquet (Hugging Face datasets' files), "
            "or auto (told by --data)",
            choices=FORMATS,
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
        metadata=option("Parquet: the column holding each label (an integer); absent: every label is -1"),
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
    seed: int = field(
        default=0,
        metadata=option("seeds the epoch permutations and all augmentation randomness", check=checks.seed),
    )
    slots: int = field(
        default=0,
        metadata=option(
            "batches in the shared-memory pool; 0 picks 2*workers+8 for the first feed, "
            f"{EXTRA_FEED_SLOTS} for a [feeds.NAME] one",
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


@dataclass(frozen=True, kw_only=True)
class ServiceConfig(FeedOptions):
    """Everything the loader service process needs, frozen after validation."""

    endpoint: str = field(
        metadata=option(
            "ZeroMQ endpoint trainers connect to: ipc:///path.sock (at most 107 bytes, in an existing "
            "directory) or tcp://host:port",
            check=checks.endpoint,
        )
    )
    workers: WorkerCount = field(
        default=WorkerCount(0),
        metadata=option(
            "decode worker processes: auto (the default: as many as the trainers' waits call for, "
            "within the CPUs this service may use; NOTE [ Sizing workers ]) or a number, which pins it",
            check=at_least(0),
        ),
    )
    max_workers: int = field(
        default=0,
        metadata=option(
            "with --workers auto, the most workers it may use (all started, the unused ones parked); "
            f"0: {AUTO_MAX_WORKERS_PER_CORE} per core of the CPU budget (at least {MIN_AUTO_WORKERS}, "
            f"at most {MAX_AUTO_WORKERS})",
            check=between(0, 1024),
        ),
    )
    cpu_budget: float = field(
        default=0.0,
        metadata=option(
            "cores the decode workers may use together; 0: what this process's affinity and cgroup CPU "
            "quota allow (NOTE [ CPU budget ]); less keeps cores for a trainer on the same host",
            check=at_least(0),
        ),
    )
    feed: str = field(
        default="train",
        metadata=option("the name trainers may select the first feed by", check=checks.feed_name),
    )
    client_timeout: float = field(
        default=15.0,
        metadata=option("seconds of trainer silence before its leases are reclaimed", check=positive),
    )
    heartbeat_interval: float = field(
        default=1.0,
        metadata=option("seconds between heartbeats, asked of trainers and sent to them", check=positive),
    )
    lag_timeout: float = field(
        default=30.0,
        metadata=option("seconds one broadcast member may hold its group up before eviction", check=positive),
    )
    task_timeout: float = field(
        default=20.0,
        metadata=option(
            "seconds a worker may spend on one sample, hearing nothing from the data's store, before it is "
            "killed, that sample skipped as bad and the rest of its batch redone (well under a trainer's "
            "60 s timeout)",
            check=positive,
        ),
    )
    strict: bool = field(
        default=False,
        metadata=option("stop (exit 1) at the first file that cannot be decoded, instead of skipping it"),
    )
    max_pixels: int = field(
        default=89_478_485,
        metadata=option(
            "refuse images whose header claims more pixels, before their pixels are allocated",
            check=between(10_000, 2**40),
        ),
    )
    max_file_bytes: int = field(
        default=DEFAULT_MAX_FILE_BYTES,
        metadata=option(
            "a dataset file larger than this is a bad sample, refused before it is read",
            check=at_least(1),
        ),
    )
    decoder: str = field(
        default="auto",
        metadata=option(
            "train and eval JPEG decoding: auto (the region decoder if built), opencv (always a full "
            "decode) or jpeg-roi (refuse to start without the region decoder)",
            choices=DECODERS,
            check=checks.decoder,
        ),
    )
    group: str = field(
        default="",
        metadata=option("Unix group that may attach: segments and the ipc socket become 0660 (else 0600)"),
    )
    curve_secret_key: str = field(
        default="",
        metadata=option(
            "the service's CURVE key pair (a NAME.key_secret from `loader-service keys`): the endpoint "
            "then admits only trainers whose keys are in --curve-authorized, and encrypts everything"
        ),
    )
    curve_authorized: str = field(
        default="",
        metadata=option("folder whose *.key files are the trainers allowed in (re-read on SIGHUP)"),
    )
    insecure_tcp: bool = field(
        default=False,
        metadata=option(
            "allow a tcp:// endpoint, loopback included, without CURVE (a warning at every start)"
        ),
    )
    max_sessions: int = field(
        default=256, metadata=option("trainers attached at once, at most", check=between(1, 65536))
    )
    metrics_port: int = field(
        default=0,
        metadata=option(
            "serve Prometheus metrics on this port (0: off; needs prometheus_client)",
            check=between(0, 65535, "0 (off)"),
        ),
    )
    metrics_addr: str = field(default="127.0.0.1", metadata=option("address the metrics port listens on"))
    stop_with_stdin: bool = field(
        default=False,
        metadata=option(
            "stop, as on SIGTERM, when standard input reaches its end: a process that starts the service "
            "with a pipe there stops it by exiting, however it exits (NOTE [ Stop with stdin ])"
        ),
    )
    cache_dir: str = field(
        default="",
        metadata=option(
            "folder that keeps what is fetched from an object store (up to --cache-size) and every "
            "feed's index, across restarts (NOTE [ Fetch cache ]); empty: keep nothing"
        ),
    )
    cache_size: ByteSize = field(
        default=ByteSize(0),
        metadata=option(
            "the most bytes --cache-dir may hold (200G, 512M): objects that do not fit are read from "
            "the store every time",
            check=at_least(0),
        ),
    )
    storage_options: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """``--storage-option KEY=VALUE`` flags and the ``[storage]`` table: obstore settings the
    environment does not give (``endpoint``, ``region``...). Values may be secret: never logged."""
    log_level: str = field(
        default="INFO", metadata=option("DEBUG, INFO, WARNING or ERROR", check=checks.log_level)
    )
    extra_feeds: tuple[FeedConfig, ...] = ()
    """Further feeds from ``[feeds.NAME]`` tables of the config file (not an option of its own)."""

    @property
    def pool_slots(self) -> int:
        return self.slots or 2 * self.first_workers + 8

    @property
    def budget(self) -> Budget:
        """The CPU budget (NOTE [ CPU budget ]): ``--cpu-budget``, else the host's limits."""
        if self.cpu_budget:
            return Budget(self.cpu_budget, f"--cpu-budget {self.cpu_budget:g}")
        return _host_budget()

    @property
    def worker_processes(self) -> int:
        """Decode worker processes started: the pinned count, or the most ``auto`` may use."""
        if self.workers:
            return int(self.workers)
        if self.max_workers:
            return self.max_workers
        cores = self.budget.cores
        return max(MIN_AUTO_WORKERS, min(MAX_AUTO_WORKERS, math.ceil(AUTO_MAX_WORKERS_PER_CORE * cores)))

    @property
    def first_workers(self) -> int:
        """Workers taking tasks at start: the pinned count, or one per core of the budget."""
        if self.workers:
            return int(self.workers)
        return max(1, min(self.worker_processes, math.floor(self.budget.cores)))

    def feeds(self) -> tuple[FeedConfig, ...]:
        """Every feed this service serves; the first one is what a trainer gets by default."""
        shared = {f.name: getattr(self, f.name) for f in fields(FeedOptions)}
        main = FeedConfig(name=self.feed, **{**shared, "slots": self.pool_slots})
        storage = self.storage()
        return tuple(
            replace(
                f,
                max_file_bytes=self.max_file_bytes,
                max_pixels=self.max_pixels,
                roi=self.roi,
                storage=storage,
            )
            for f in (main, *self.extra_feeds)
        )

    def storage(self) -> StorageConfig:
        """How every feed reaches its data; a worker's reads may take half the task timeout, so one
        waiting on a slow store is not taken for a hung decoder (NOTE [ Object store reads ])."""
        return StorageConfig(self.storage_options, self.cache_dir, self.cache_size, self.task_timeout / 2)

    def validated(self) -> ServiceConfig:
        """Return a copy with the data path resolved, or raise ConfigError naming the bad value."""
        if found := _first_problem(self, OPTIONS):
            raise ConfigError(found[1], key=found[0])
        require(self.pool_slots >= 2, "slots must be at least 2", key="slots")
        require(
            self.client_timeout >= 2 * self.heartbeat_interval,
            "client_timeout must be at least twice heartbeat_interval",
        )
        problem = checks.security(
            self.endpoint, self.curve_secret_key, self.curve_authorized, self.insecure_tcp
        )
        require(problem is None, problem or "")
        names = [f.name for f in self.extra_feeds]
        require(len(set(names)) == len(names) and self.feed not in names, "feed names must be unique")
        require(
            bool(self.cache_dir) == bool(self.cache_size),
            "cache_dir and cache_size go together: a folder, and the most bytes it may hold",
            key="cache_size" if self.cache_dir else "cache_dir",
        )
        _check_fields(self, "")
        return replace(
            self,
            data=_resolve(self.data),
            pipeline=_resolve_pipeline(self.pipeline),
            log_level=self.log_level.upper(),
            extra_feeds=tuple(f.validated() for f in self.extra_feeds),
            cache_dir=str(_resolve(self.cache_dir)) if self.cache_dir else "",
        )

    @property
    def roi(self) -> bool:
        """Whether decode workers use the region decoder."""
        return uses_roi(self.decoder)

    def summary(self) -> str:
        """Every setting, for the log; of the storage options only their keys (values may be secret)."""
        hidden = ("storage_options", "extra_feeds")
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in hidden}
        feeds = [{k: v for k, v in asdict(feed).items() if k != "storage"} for feed in self.extra_feeds]
        secret = " ".join(f"{k}=***" for k, _ in self.storage_options)
        text = " ".join(f"{k}={v}" for k, v in shown.items())
        return f"{text} extra_feeds={feeds} pool_slots={self.pool_slots} {secret}".rstrip()


@dataclass(frozen=True, kw_only=True)
class FeedConfig(FeedOptions):
    """One feed: a dataset and how its batches are made. The service may serve several."""

    name: str
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    """The service-wide ``max_file_bytes``, set by ``ServiceConfig.feeds()``; its workers apply it."""
    max_pixels: int = 0
    """The service-wide ``max_pixels``, set by ``ServiceConfig.feeds()`` (0: not set)."""
    roi: bool = False
    """Whether the service-wide ``decoder`` is the region decoder, set by ``ServiceConfig.feeds()``."""
    storage: StorageConfig = LOCAL
    """The service-wide storage settings, set by ``ServiceConfig.feeds()``."""

    def validated(self) -> FeedConfig:
        """The same checks as the top-level options, each message prefixed with the feed's name."""
        where = f"feed {self.name!r}: "
        if problem := checks.feed_name("name", self.name):
            raise ConfigError(where + problem)
        if found := _first_problem(self, FEED_OPTIONS):
            raise ConfigError(where + found[1])
        slots = self.slots or EXTRA_FEED_SLOTS
        require(slots >= 2, where + "slots must be at least 2")
        _check_fields(self, where)
        return replace(self, data=_resolve(self.data), pipeline=_resolve_pipeline(self.pipeline), slots=slots)


@dataclass(frozen=True)
class Option:
    """One setting as the command line, the TOML file and the environment see it."""

    name: str
    type: type
    """``int``, ``float``, ``str``, ``bool`` or ``Path``: from the field's annotation."""
    default: Any
    help: str
    choices: tuple[str, ...]
    check: Check | None
    per_feed: bool
    """Also a key of ``[feeds.NAME]`` tables."""

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type, or None."""
        if self.choices and value not in self.choices:
            return f"{self.name} must be one of {', '.join(self.choices)}"
        return self.check(self.name, value) if self.check else None

    def typed(self, value: Any, where: str) -> Any:
        """A TOML or flag value as this option's type, or ConfigError naming ``where`` it came from."""
        if self.type is Path and isinstance(value, (str, os.PathLike)):
            require(str(value) != "", f"{where} is empty")  # Path("") would quietly mean the cwd
            return Path(value)
        if self.type is str and isinstance(value, os.PathLike):  # a caller's Path for data, say
            return os.fspath(value)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if self.type is ByteSize:
            return _byte_size(value, where)
        if self.type is WorkerCount:
            return _worker_count(value, where)
        # bool is an int to isinstance, but `workers = true` is a mistake, not 1.
        if isinstance(value, self.type) and (self.type is bool or not isinstance(value, bool)):
            return value
        raise ConfigError(f"{where} has the wrong type ({type(value).__name__})")

    def parse(self, text: str, variable: str) -> Any:
        """An environment variable's text as this option's type, or ConfigError naming the variable."""
        try:
            value = _FROM_TEXT[self.type](text)
        except ValueError:
            raise ConfigError(f"{variable}={text!r} is not {_KIND[self.type]}") from None
        return self.typed(value, variable)


@functools.cache
def _host_budget() -> Budget:
    """The host's CPU budget, read once: ``pool_slots``, ``worker_processes``, ``first_workers`` and
    the log all ask for it at start-up, and must agree."""
    return cpu_budget()


def _worker_count(value: Any, where: str) -> WorkerCount:
    """A TOML or flag value of ``workers``: an integer, or ``"auto"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f'{where} must be "auto" or a whole number')
    try:
        return WorkerCount(value)
    except ValueError:
        raise ConfigError(f'{where} must be "auto" or a whole number, not {value!r}') from None


def _byte_size(value: Any, where: str) -> ByteSize:
    """A TOML or flag value of a size option: an integer of bytes, or text such as ``"64G"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f'{where} must be a whole number of bytes or text such as "64G"')
    if isinstance(value, int) and not 0 <= value < MAX_BYTES:
        raise ConfigError(f"{where} must be between 0 and 2**62 bytes")
    try:
        return ByteSize(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


_FROM_TEXT: dict[type, Callable[[str], Any]] = {
    int: int,
    float: float,
    bool: _boolean,
    str: str,
    Path: str,
    ByteSize: ByteSize,
    WorkerCount: WorkerCount,
}
_KIND = {
    int: "an integer",
    float: "a number",
    bool: "a boolean (1, true, yes, on or 0, false, no, off)",
    str: "text",
    Path: "a path",
    ByteSize: "a size such as 64G, 512M or 1000000",
    WorkerCount: "auto or a whole number",
}


def _options() -> dict[str, Option]:
    hints = typing.get_type_hints(ServiceConfig)
    per_feed = {f.name for f in fields(FeedOptions)}
    return {
        f.name: Option(
            f.name, hints[f.name], f.default, **asdict(f.metadata["option"]), per_feed=f.name in per_feed
        )
        for f in fields(ServiceConfig)
        if "option" in f.metadata
    }


OPTIONS: dict[str, Option] = _options()
"""Every option of the service, in declaration order: the flags, TOML keys and variables there are."""
FEED_OPTIONS: dict[str, Option] = {name: o for name, o in OPTIONS.items() if o.per_feed}
"""The keys a ``[feeds.NAME]`` table may hold."""


def _first_problem(config: FeedOptions, options: Mapping[str, Option]) -> tuple[str, str] | None:
    for name, opt in options.items():
        if problem := opt.problem(getattr(config, name)):
            return name, problem
    return None


def _resolve(data: str | Path) -> str:
    """A local path made absolute (workers need not share our cwd); an object store URL as given."""
    return str(data) if is_remote(data) else str(Path(data).expanduser().resolve())


def _resolve_pipeline(spec: str) -> str:
    """A FILE.py:FUNC pipeline with its file made absolute: workers need not share our cwd."""
    module, _, func = spec.rpartition(":")
    return f"{_resolve(module)}:{func}" if module.endswith(".py") else spec


def _check_fields(config: FeedOptions, where: str) -> None:
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


def require(ok: bool, message: str, key: str = "") -> None:
    if not ok:
        raise ConfigError(message, key)
