"""The service's one typed configuration: CLI flags and a TOML file land here, validated once.

Precedence: built-in defaults < TOML file (``--config``) < command-line flags.
TOML keys are the flag names with underscores (``batch_size = 64``); unknown keys are an error, so a
typo in a config file is caught at start-up instead of silently falling back to a default.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from loader_service.decode.transforms import decoder_problem, uses_roi

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AUGMENTS = ("train", "eval", "none")


class ConfigError(ValueError):
    """A configuration value that the service cannot run with; the message says which and why."""


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the loader service process needs, frozen after validation."""

    data: Path
    """ImageFolder root: one sub-folder per class."""
    endpoint: str
    """ZeroMQ endpoint trainers connect to, e.g. ``ipc:///run/dataferry/train.sock`` or ``tcp://127.0.0.1:5555``."""
    workers: int = 2
    """Decode worker processes."""
    batch_size: int = 64
    image_size: int = 224
    augment: str = "train"
    """``train`` (RandomResizedCrop + flip), ``eval`` (resize + center crop) or ``none`` (resize)."""
    seed: int = 0
    """Seeds the epoch permutations and all augmentation randomness."""
    slots: int = 0
    """Batches in the shared-memory pool; 0 picks ``2 * workers + 8``."""
    feed: str = "train"
    """Name trainers may select the feed by."""
    client_timeout: float = 15.0
    """Seconds without a heartbeat after which a trainer's leases are reclaimed."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats the service asks trainers to send, and sends them itself."""
    log_level: str = "INFO"
    strict: bool = False
    """Stop the service at the first file that cannot be decoded, instead of skipping it."""
    max_pixels: int = 89_478_485
    """Images whose header claims more pixels are refused before their pixels are allocated."""
    group: str = ""
    """Unix group that may attach: segments and the ipc socket become 0660 owned by it (else 0600)."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off); needs the prometheus_client package."""
    metrics_addr: str = "127.0.0.1"
    task_timeout: float = 120.0
    """Seconds one batch may take a worker before it is killed and the batch redone (hung I/O)."""
    lag_timeout: float = 30.0
    """Seconds a broadcast group may be held up by one member before that member is evicted."""
    decoder: str = "auto"
    """JPEG decoding for the train transform: ``auto`` (the region decoder when it is built),
    ``opencv`` (always a full decode) or ``jpeg-roi`` (refuse to start without the region decoder)."""
    extra_feeds: tuple[FeedConfig, ...] = ()
    """Further feeds from ``[feeds.NAME]`` tables of the config file."""

    @property
    def pool_slots(self) -> int:
        return self.slots or 2 * self.workers + 8

    def feeds(self) -> tuple[FeedConfig, ...]:
        """Every feed this service serves; the first one is what a trainer gets by default."""
        main = FeedConfig(
            self.feed, self.data, self.batch_size, self.image_size, self.augment, self.seed, self.pool_slots
        )
        return (main, *self.extra_feeds)

    def validated(self) -> ServiceConfig:
        """Return a copy with the data path resolved, or raise ConfigError naming the bad value."""
        _check(self.workers >= 1, "workers must be at least 1")
        _check(1 <= self.batch_size <= 4096, "batch_size must be between 1 and 4096")
        _check(8 <= self.image_size <= 2048, "image_size must be between 8 and 2048")
        _check(self.augment in AUGMENTS, f"augment must be one of {', '.join(AUGMENTS)}")
        _check(0 <= self.seed < 2**63, "seed must be a non-negative 63-bit integer")
        _check(0 <= self.slots <= 4096, "slots must be between 0 (auto) and 4096")
        _check(self.pool_slots >= 2, "slots must be at least 2")
        _check(bool(self.feed) and len(self.feed) <= 64, "feed must be a name of 1 to 64 characters")
        _check(self.heartbeat_interval > 0, "heartbeat_interval must be positive")
        _check(
            self.client_timeout >= 2 * self.heartbeat_interval,
            "client_timeout must be at least twice heartbeat_interval",
        )
        _check(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "bad log_level")
        _check_endpoint(self.endpoint)
        _check(self.lag_timeout > 0, "lag_timeout must be positive")
        _check(self.task_timeout > 0, "task_timeout must be positive")
        _check(10_000 <= self.max_pixels <= 2**40, "max_pixels must be between 10000 and 2**40")
        if problem := decoder_problem(self.decoder):
            raise ConfigError(problem)
        _check(0 <= self.metrics_port <= 65535, "metrics_port must be a TCP port (0: off)")
        names = [f.name for f in self.extra_feeds]
        _check(len(set(names)) == len(names) and self.feed not in names, "feed names must be unique")
        return replace(
            self,
            data=_resolve_data(self.data),
            log_level=self.log_level.upper(),
            extra_feeds=tuple(f.validated() for f in self.extra_feeds),
        )

    @property
    def roi(self) -> bool:
        """Whether decode workers use the region decoder."""
        return uses_roi(self.decoder)

    def summary(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items()) + f" pool_slots={self.pool_slots}"


@dataclass(frozen=True)
class FeedConfig:
    """One feed: a dataset and how its batches are made. The service may serve several."""

    name: str
    data: Path
    batch_size: int = 64
    image_size: int = 224
    augment: str = "train"
    seed: int = 0
    slots: int = 10

    def validated(self) -> FeedConfig:
        where = f"feed {self.name!r}: "
        _check(bool(self.name) and len(self.name) <= 64, where + "name must be 1 to 64 characters")
        _check(1 <= self.batch_size <= 4096, where + "batch_size must be between 1 and 4096")
        _check(8 <= self.image_size <= 2048, where + "image_size must be between 8 and 2048")
        _check(self.augment in AUGMENTS, where + f"augment must be one of {', '.join(AUGMENTS)}")
        _check(0 <= self.seed < 2**63, where + "seed must be a non-negative 63-bit integer")
        _check(2 <= self.slots <= 4096, where + "slots must be between 2 and 4096")
        return replace(self, data=_resolve_data(self.data))


def _resolve_data(data: Path) -> Path:
    resolved = Path(data).expanduser().resolve()
    _check(resolved.is_dir(), f"data directory {data} does not exist or is not a directory")
    return resolved


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_endpoint(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        # The kernel's sockaddr_un limit: longer paths fail obscurely inside libzmq.
        _check(0 < len(path.encode()) <= 107, f"ipc path must be 1 to 107 bytes: {endpoint}")
        parent = os.path.dirname(path) or "."
        _check(os.path.isdir(parent), f"directory for ipc endpoint does not exist: {parent}")
    else:
        _check(endpoint.startswith("tcp://"), f"endpoint must be ipc://PATH or tcp://HOST:PORT: {endpoint}")


_FIELDS = {f.name: f for f in fields(ServiceConfig)}


def load_config(file: Path | None, overrides: dict[str, Any]) -> ServiceConfig:
    """Merge a TOML file and flag overrides (None means 'not given') into a validated config."""
    values: dict[str, Any] = {}
    if file is not None:
        values.update(_read_toml(file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("data", "endpoint"):
        _check(key in values, f"{key} is required (flag --{key} or key '{key}' in the config file)")
    values["data"] = Path(values["data"])
    try:
        values["extra_feeds"] = _extra_feeds(values.pop("feeds", {}), values)
        return ServiceConfig(**values).validated()
    except TypeError as exc:  # a wrong-typed value from TOML
        raise ConfigError(str(exc)) from None


_FEED_KEYS = ("data", "batch_size", "image_size", "augment", "seed", "slots")


def _extra_feeds(tables: dict[str, Any], top: dict[str, Any]) -> tuple[FeedConfig, ...]:
    """``[feeds.NAME]`` tables; keys not given there default to the top-level (first feed's) values."""
    feeds = []
    for name, table in tables.items():
        _check(isinstance(table, dict), f"[feeds.{name}] must be a table")
        unknown = sorted(set(table) - set(_FEED_KEYS))
        _check(not unknown, f"unknown keys in [feeds.{name}]: {', '.join(unknown)}")
        _check("data" in table, f"[feeds.{name}] needs a data directory")
        for key, value in table.items():
            want = str if key in ("data", "augment") else int
            _check(
                isinstance(value, want) and not isinstance(value, bool),
                f"[feeds.{name}] key {key!r} has the wrong type ({type(value).__name__})",
            )
        inherited = {k: top[k] for k in _FEED_KEYS[1:] if k in top and k != "slots"}
        merged = {**inherited, **table, "data": Path(table["data"])}
        feeds.append(FeedConfig(name=name, **merged))
    return tuple(feeds)


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from None
    unknown = sorted(set(raw) - set(_FIELDS) - {"feeds"} | ({"extra_feeds"} & set(raw)))
    _check(not unknown, f"unknown keys in {file}: {', '.join(unknown)}")
    for key, value in raw.items():
        if key == "feeds":
            _check(isinstance(value, dict), f"{file}: 'feeds' must hold [feeds.NAME] tables")
            continue
        kinds = {"int": int, "float": (int, float), "str": str, "Path": str, "bool": bool}
        expected = kinds[str(_FIELDS[key].type)]
        _check(
            isinstance(value, expected) and (expected is bool or not isinstance(value, bool)),  # type: ignore[arg-type]
            f"{file}: key {key!r} has the wrong type ({type(value).__name__})",
        )
    return raw
