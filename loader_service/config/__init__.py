"""The service's one typed configuration: each option declared once (``options.py``), loaded in
layers (``loading.py``)."""

from loader_service.config.loading import load_config
from loader_service.config.options import (
    AUGMENTS,
    EXTRA_FEED_SLOTS,
    FEED_OPTIONS,
    OPTIONS,
    ConfigError,
    FeedConfig,
    Option,
    ServiceConfig,
)

__all__ = [
    "AUGMENTS",
    "EXTRA_FEED_SLOTS",
    "FEED_OPTIONS",
    "OPTIONS",
    "ConfigError",
    "FeedConfig",
    "Option",
    "ServiceConfig",
    "load_config",
]
