"""What a ``ServiceLoader`` is asked for: one frozen config, defaults resolved and validated once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from gpu_worker.names import name_of
from protocol.layout import FieldSpec
from protocol.messages import MODES, REMAINDERS, TRANSPORTS
from protocol.weights import MAX_EPOCH_SAMPLES, check_weight

TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
DECODES = ("service", "trainer", "auto")
"""Where a trainer's rows are decoded: all by the service, every row the service can send encoded
by this trainer, or a share found while the loop runs (NOTE [ Finding the split ] in
gpu_worker/split.py)."""
MAX_DECODE_THREADS = 64

HELLO_FIELDS = (
    "feed", "credits", "mode", "rank", "world_size", "remainder", "group", "group_size", "batch_size",
    "image_size", "group_secret", "weights", "epoch_samples",
)  # fmt: skip
"""The fields a hello carries to the service; the others only matter in the trainer's process."""
GROUP_SECRET_ENV = "DATAFERRY_GROUP_SECRET"
"""Where ``group_secret`` comes from when the code does not give one."""
ENDPOINTS_ENV = "DATAFERRY_ENDPOINTS"
"""Comma-separated endpoints that take the place of those the code names (a fleet, no code change)."""
MAX_ENDPOINTS = 64
"""Places in one fleet: the endpoints given, and addresses found behind a name (NOTE [ A fleet
from a name ] in gpu_worker/names.py: those that answer keep theirs, silent ones take turns)."""
MAX_ADDRESSES = 1024
"""Addresses of one name taken from an answer (the lowest), since the answer is a peer's word."""
MIN_RESOLVE_INTERVAL = 0.1


@dataclass(frozen=True)
class LoaderConfig:
    """Everything a ``ServiceLoader`` is asked for, validated once."""

    endpoints: tuple[str, ...]
    """One service, or a fleet of them (NOTE [ A fleet ] in gpu_worker/fleet_pass.py)."""
    _: KW_ONLY  # the rest by name: too many to pass in order
    device: str = "cpu"
    feed: str = ""
    credits: int = 6
    timeout: float = 60.0
    connect_timeout: float = 30.0
    mode: str = "shard"
    rank: int = 0
    world_size: int = 1
    remainder: str = "pad"
    group: str = "default"
    group_size: int = 1
    batch_size: int = 0
    image_size: int = 0
    transport: str = "auto"
    """``shm`` maps the service's segment, ``tcp`` receives each batch's bytes over the socket, ``auto``
    maps the segment where it can really be opened and checked (the service's host), else ``tcp``."""
    fields: tuple[FieldSpec, ...] = ()
    """The fields the trainer expects, in order (``gpu_worker.fields``); () takes what the feed has."""
    group_secret: str = field(default="", repr=False)
    """Broadcast: shared by the group's members; outsiders without it cannot join or hold it up."""
    resolve_interval: float = 5.0
    """Seconds between lookups of an endpoint that names a host (NOTE [ A fleet from a name ] in
    gpu_worker/names.py); 0 looks it up once, at the start."""
    weights: tuple[tuple[str, float], ...] = ()
    """A mixture over the feed's named sources (NOTE [ Mixture order ]); () the feed's own order."""
    epoch_samples: int = 0
    """With ``weights``: samples in an epoch; 0 the feed's size."""
    decode: str = "service"
    """Who decodes the rows the service can send encoded: ``service``, ``trainer`` or ``auto`` (a
    share found while the loop runs: NOTE [ Finding the split ] in gpu_worker/split.py)."""
    decode_threads: int = 1
    """Threads that decode encoded rows in this process."""

    @property
    def endpoint(self) -> str:
        """The first service's endpoint."""
        return self.endpoints[0]

    def validated(self) -> LoaderConfig:
        if not 1 <= len(self.endpoints) <= MAX_ENDPOINTS:
            raise ValueError(f"give 1 to {MAX_ENDPOINTS} endpoints, got {len(self.endpoints)}")
        for endpoint in self.endpoints:
            if not endpoint.startswith(("ipc://", "tcp://")):
                raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
            name_of(endpoint)  # a tcp:// endpoint needs a host and a port
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"an endpoint is named twice: {', '.join(self.endpoints)}")
        if self.mode == "broadcast" and len(self.endpoints) > 1:
            raise ValueError(
                "a broadcast group is fed by one service (its members share each decoded batch there); "
                f"give one endpoint, not {len(self.endpoints)}"
            )
        if not 2 <= self.credits <= 1024:
            raise ValueError(
                "credits must be between 2 and 1024 (a loop holds one batch while fetching the next)"
            )
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.resolve_interval != 0 and not MIN_RESOLVE_INTERVAL <= self.resolve_interval <= 3600:
            raise ValueError(
                f"resolve_interval must be 0 (look names up once) or {MIN_RESOLVE_INTERVAL} to 3600 "
                f"seconds, got {self.resolve_interval}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {', '.join(REMAINDERS)}, got {self.remainder!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.transport!r}"
            )
        if not 1 <= self.group_size <= 1024 or not self.group or len(self.group) > 64:
            raise ValueError("group must be a name of 1 to 64 characters and group_size 1 to 1024")
        if len(self.group_secret) > 64:
            raise ValueError("group_secret must be at most 64 characters")
        for name, weight in self.weights:
            check_weight(name, weight)
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}")
        if type(self.decode_threads) is not int or not 1 <= self.decode_threads <= MAX_DECODE_THREADS:
            raise ValueError(f"decode_threads must be 1 to {MAX_DECODE_THREADS}, got {self.decode_threads!r}")
        if self.epoch_samples < 0 or (self.epoch_samples and not self.weights):
            raise ValueError("epoch_samples goes with weights, and is 0 (the feed's size) or more")
        if self.epoch_samples > MAX_EPOCH_SAMPLES:
            raise ValueError(
                f"epoch_samples is at most {MAX_EPOCH_SAMPLES}, got {self.epoch_samples} (choose a smaller "
                "one: the run goes on across epochs)"
            )
        return self

    def hello_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in HELLO_FIELDS}


def endpoints_from_env() -> tuple[str, ...]:
    """The endpoints ``DATAFERRY_ENDPOINTS`` names; none when it is unset or empty."""
    return tuple(part.strip() for part in os.environ.get(ENDPOINTS_ENV, "").split(",") if part.strip())


def endpoints_of(given: str | Sequence[str] | None) -> tuple[str, ...]:
    """The endpoints to use: ``DATAFERRY_ENDPOINTS`` when set, else what the code gave."""
    from_env = endpoints_from_env()
    if from_env:
        return from_env
    if given is None:
        raise ValueError(f"no endpoint: name one (or several), or set {ENDPOINTS_ENV}")
    return (given,) if isinstance(given, str) else tuple(given)


def shard_of(mode: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): as given, else torchrun's RANK / WORLD_SIZE; always (0, 1) outside shard mode."""
    if mode != "shard":
        return 0, 1
    return (
        _env_int("RANK", 0) if rank is None else rank,
        _env_int("WORLD_SIZE", 1) if world_size is None else world_size,
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
