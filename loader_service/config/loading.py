"""Loading the configuration one layer at a time: defaults < TOML file < environment < flags."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loader_service.config.feed import parse_sources
from loader_service.config.options import FEED_OPTIONS, OPTIONS, FeedConfig, ServiceConfig
from loader_service.config.values import ConfigError, require
from protocol.layout import FieldSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


NOT_INHERITED = (
    "slots",
    "format",
    "image_column",
    "label_column",
    "pipeline",
    "pipeline_deterministic",
    "cache_memory",
)
"""Top-level feed options a ``[feeds.NAME]`` table does not take over (nor ``fields``, not an option)."""

SOURCES_TABLE = "sources"
"""The config file's table of a feed's named sources (``--source``)."""
STORAGE_TABLE = "storage"
"""The config file's table of ``--storage-option`` settings."""
Layer = dict[str, tuple[Any, str]]
"""Option name -> (typed value, where it was set), for error messages that say which layer is wrong."""


def load_config(
    file: Path | None,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
    storage_flags: Sequence[str] = (),
    source_flags: Sequence[str] = (),
) -> ServiceConfig:
    """Merge defaults < TOML ``file`` < ``environ`` < flag ``overrides`` (None: not given), validated.
    ``storage_flags``: the ``--storage-option KEY=VALUE`` flags, over the file's ``[storage]`` table;
    ``source_flags``: the ``--source NAME=DATA`` flags, instead of the file's ``[sources]`` table."""
    file_layer, tables, stored = _read_file(file) if file is not None else ({}, {}, {})
    merged: Layer = {**file_layer, **_env_layer(environ), **_flag_layer(overrides)}
    if source_flags:
        merged["sources"] = (parse_sources(source_flags, "--source"), "--source")
    values = {name: value for name, (value, _) in merged.items()}
    _check_required(values)
    storage = {**_storage_table(stored, file), **parse_storage_flags(storage_flags)}
    try:
        return ServiceConfig(
            **values, extra_feeds=_extra_feeds(tables, values), storage_options=tuple(storage.items())
        ).validated()
    except ConfigError as exc:
        if exc.key in merged:
            raise ConfigError(f"{exc} (set by {merged[exc.key][1]})", exc.key) from None
        raise


def _flag_layer(overrides: Mapping[str, Any]) -> Layer:
    unknown = sorted(set(overrides) - set(OPTIONS))
    require(not unknown, f"unknown options: {', '.join(unknown)}")
    layer: Layer = {}
    for name, value in overrides.items():
        if value is not None:
            opt = OPTIONS[name]
            layer[name] = (opt.typed(value, opt.flag), opt.flag)
    return layer


def _env_layer(environ: Mapping[str, str]) -> Layer:
    # Only declared names are read: other DATAFERRY_* variables belong to someone else.
    return {o.name: (o.parse(environ[o.env], o.env), o.env) for o in OPTIONS.values() if o.env in environ}


def _storage_table(table: Any, file: Path | None) -> dict[str, str]:
    """``[storage]``: obstore settings, ``endpoint = "http://..."``; numbers and booleans as text."""
    require(isinstance(table, dict), f"{file}: [storage] must be a table of KEY = VALUE")
    out = {}
    for key, value in table.items():
        require(
            isinstance(value, (str, int, float, bool)),
            f"{file}: [storage] {key} must be text, a number or a boolean",
        )
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def parse_storage_flags(flags: Sequence[str]) -> dict[str, str]:
    out = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        # Not the text itself: a value given without its key may be a secret.
        require(
            bool(sep) and bool(key.strip()), "--storage-option needs KEY=VALUE (the text given is not shown)"
        )
        out[key.strip()] = value
    return out


def _check_required(values: Mapping[str, Any]) -> None:
    for opt in OPTIONS.values():
        if opt.required and opt.name not in values:
            where = f"flag {opt.flag}, variable {opt.env} or key '{opt.name}' in the config file"
            raise ConfigError(f"{opt.name} is required ({where})")


def _read_file(file: Path) -> tuple[Layer, dict[str, Any], Any]:
    """The file's top-level options, its ``[feeds.NAME]`` tables (checked when feeds are built), and
    its ``[storage]`` table."""
    raw = _read_toml(file)
    tables = raw.pop("feeds", {})
    require(isinstance(tables, dict), f"{file}: 'feeds' must hold [feeds.NAME] tables")
    stated = raw.pop("fields", None)
    stored = raw.pop(STORAGE_TABLE, {})
    named = raw.pop(SOURCES_TABLE, None)
    unknown = sorted(set(raw) - set(OPTIONS))
    require(not unknown, f"unknown keys in {file}: {', '.join(unknown)}")
    layer = {k: (OPTIONS[k].typed(v, f"{file}: key {k!r}"), str(file)) for k, v in raw.items()}
    if stated is not None:
        layer["fields"] = (field_specs(stated, f"{file}: [fields]"), str(file))
    if named is not None:
        layer["sources"] = (source_table(named, f"{file}: [sources]"), str(file))
    return layer, tables, stored


def source_table(table: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``[sources]``: ``NAME = "DATA"`` per source, in the order the feed numbers them."""
    require(isinstance(table, dict) and bool(table), f"{where} must be a table of NAME = DATA")
    for name, data in table.items():
        require(isinstance(data, str), f"{where}: {name} must be the source's data as text")
    return tuple(table.items())


def field_specs(table: Any, where: str) -> tuple[FieldSpec, ...]:
    """``[fields]``: ``NAME = { dtype = "float16", shape = [3, 224, 224] }`` per field, in batch order."""
    require(isinstance(table, dict) and bool(table), f"{where} must be a table of one or more fields")
    specs = []
    for name, spec in table.items():
        require(
            isinstance(spec, dict) and set(spec) == {"dtype", "shape"} and isinstance(spec["shape"], list),
            f'{where}: {name} must be {{ dtype = "...", shape = [...] }} (shape [] for a scalar)',
        )
        try:
            specs.append(FieldSpec(name, spec["dtype"], tuple(spec["shape"])))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return tuple(specs)


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from None


def _extra_feeds(tables: Mapping[str, Any], top: Mapping[str, Any]) -> tuple[FeedConfig, ...]:
    return tuple(_extra_feed(name, table, top) for name, table in tables.items())


def _extra_feed(name: str, table: Any, top: Mapping[str, Any]) -> FeedConfig:
    """``[feeds.NAME]``: the feed options it sets, the rest inherited from the top level (but slots)."""
    where = f"[feeds.{name}]"
    require(isinstance(table, dict), f"{where} must be a table")
    stated = table.get("fields")
    named = table.get(SOURCES_TABLE)
    unknown = sorted(set(table) - set(FEED_OPTIONS) - {"fields", SOURCES_TABLE})
    require(not unknown, f"unknown keys in {where}: {', '.join(unknown)}")
    require("data" in table or named is not None, f"{where} needs a data directory (or a [sources] table)")
    own: dict[str, Any] = {
        k: FEED_OPTIONS[k].typed(v, f"{where} key {k!r}")
        for k, v in table.items()
        if k not in ("fields", SOURCES_TABLE)
    }
    if stated is not None:
        own["fields"] = field_specs(stated, f"{where}.fields")
    if named is not None:
        own["sources"] = source_table(named, f"{where}.sources")
    # Each feed's pool and cache are sized on their own: inheriting the first feed's would multiply
    # memory.
    # Its format and columns go with its own data, which every table names; its pipeline (and so its
    # fields) with what the feed is for: a [feeds.val] table saying augment = "eval" must not silently
    # run the top-level feed's training pipeline.
    inherited = {k: top[k] for k in FEED_OPTIONS if k in top and k not in NOT_INHERITED}
    if named is not None:
        inherited.pop("data", None)  # its sources are its data
    return FeedConfig(name=name, **{**inherited, **own})
