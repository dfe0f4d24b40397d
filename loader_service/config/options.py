"""The service's one typed configuration: defaults, a TOML file, the environment and flags land here.

Each option is declared once, as a field of ``ServiceConfig`` below or of ``feed.FeedOptions`` (the
per-feed ones), whose metadata holds its help text,
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
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from loader_service.config import checks
from loader_service.config.checks import at_least, between, positive
from loader_service.config.cpus import Budget, cpu_budget
from loader_service.config.feed import (
    AUTO_MOST_SLOTS,
    FIRST_SLOTS,
    FeedOptions,
    absolute_path,
    check_data,
    check_fields,
    resolve_data,
    resolve_pipeline,
)
from loader_service.config.option import Option, option
from loader_service.config.values import ByteSize, ConfigError, WorkerCount, require
from loader_service.dataset.index import LOCAL
from loader_service.dataset.storage.local import DEFAULT_MAX_FILE_BYTES
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.decode.decoders import DECODERS, uses_roi

AUTO_MAX_WORKERS_PER_CORE = 4
"""``--workers auto`` may use this many workers per core of the budget (at least ``MIN_AUTO_WORKERS``,
at most ``MAX_AUTO_WORKERS``): a feed whose workers wait on a store or in a pipeline may use more
workers than cores. They are forked when the controller asks (NOTE [ Workers from a template ]);
one parked after a decrease costs the pages it wrote, no CPU."""
MIN_AUTO_WORKERS = 4
MAX_AUTO_WORKERS = 256
MAX_CPU_BUDGET = 65536
"""The most cores ``--cpu-budget`` may give: more than any host has (Linux's NR_CPUS is at most
8192), so a larger value is a mistake, and ``inf`` one the sizing cannot count with."""


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
            "with --workers auto, the most workers it may use (started as the sizing asks); "
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
            # The comparison refuses nan and inf too: inf once crashed the worker sizing at start
            # (exit 1, which systemd restarts for ever) where a bad value must stop it with exit 2.
            check=between(0, MAX_CPU_BUDGET, "0 (the host's limits)"),
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
    order_memory: ByteSize = field(
        default=ByteSize(0),
        metadata=option(
            "memory weighted jobs' epoch orders may hold together (64M, 1G): a job past it is refused "
            "by name; 0: a sixteenth of the host's memory, or of its cgroup's limit where lower "
            "(NOTE [ Orders' memory ])",
            check=at_least(0),
        ),
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
    def auto_slots(self) -> int:
        """The most slots an automatic pool may grow to (NOTE [ A pool as large as what is in
        flight ]): what the trainers hold, up to ``AUTO_MOST_SLOTS`` or every worker ``auto`` may
        start filling a batch while as many wait ready or leased, if that is more."""
        return max(AUTO_MOST_SLOTS, 2 * self.worker_processes + 8)

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
        main = FeedConfig(name=self.feed, **shared)
        storage = self.storage()
        return tuple(
            replace(
                f,
                slots=f.slots or self.auto_slots,
                first_slots=f.slots or min(FIRST_SLOTS, self.auto_slots),
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
        require(self.slots != 1, "slots must be 0 (auto) or at least 2", key="slots")
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
        check_fields(self, "")
        sources = check_data(self, "")
        return replace(
            self,
            data=resolve_data(self.data) if self.data else "",
            sources=sources,
            pipeline=resolve_pipeline(self.pipeline),
            log_level=self.log_level.upper(),
            extra_feeds=tuple(f.validated() for f in self.extra_feeds),
            cache_dir=absolute_path(self.cache_dir) if self.cache_dir else "",
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
        return f"{text} extra_feeds={feeds} {secret}".rstrip()


@dataclass(frozen=True, kw_only=True)
class FeedConfig(FeedOptions):
    """One feed: a dataset and how its batches are made. The service may serve several."""

    name: str
    first_slots: int = 0
    """Slots reserved at start, set by ``ServiceConfig.feeds()``: all ``slots`` when they were given,
    fewer for an automatic pool, which grows (NOTE [ A pool as large as what is in flight ])."""
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
        require(self.slots != 1, where + "slots must be 0 (auto) or at least 2")
        check_fields(self, where)
        sources = check_data(self, where)
        data = resolve_data(self.data) if self.data else ""
        return replace(self, data=data, sources=sources, pipeline=resolve_pipeline(self.pipeline))


@functools.cache
def _host_budget() -> Budget:
    """The host's CPU budget, read once: ``auto_slots``, ``worker_processes``, ``first_workers`` and
    the log all ask for it at start-up, and must agree."""
    return cpu_budget()


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
        if name == "data" and not config.data:
            continue  # none given: check_data says what is missing, or checks each source instead
        if problem := opt.problem(getattr(config, name)):
            return name, problem
    return None
