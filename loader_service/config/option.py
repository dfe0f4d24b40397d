"""One option as the command line, the TOML file and the environment see it, made from the metadata
of its one declaration (``option(...)`` on a field of ``options.ServiceConfig`` or ``feed.FeedOptions``)."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from loader_service.config.checks import Check
from loader_service.config.values import (
    FROM_TEXT,
    KIND_WORDS,
    ByteSize,
    ConfigError,
    WorkerCount,
    as_byte_size,
    as_worker_count,
    require,
)

ENV_PREFIX = "DATAFERRY_"


@dataclass(frozen=True)
class OptionSpec:
    help: str
    choices: tuple[str, ...]
    check: Check | None


def option(help: str, *, choices: tuple[str, ...] = (), check: Check | None = None) -> dict[str, OptionSpec]:
    """Field metadata making a config field an option: a flag, a TOML key and an environment variable."""
    return {"option": OptionSpec(help, choices, check)}


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
            return as_byte_size(value, where)
        if self.type is WorkerCount:
            return as_worker_count(value, where)
        # bool is an int to isinstance, but `workers = true` is a mistake, not 1.
        if isinstance(value, self.type) and (self.type is bool or not isinstance(value, bool)):
            return value
        raise ConfigError(f"{where} has the wrong type ({type(value).__name__})")

    def parse(self, text: str, variable: str) -> Any:
        """An environment variable's text as this option's type, or ConfigError naming the variable."""
        try:
            value = FROM_TEXT[self.type](text)
        except ValueError:
            raise ConfigError(f"{variable}={text!r} is not {KIND_WORDS[self.type]}") from None
        return self.typed(value, variable)
