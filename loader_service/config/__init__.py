"""The service's one typed configuration: each option declared once (``options.py``), loaded in
layers (``loading.py``)."""

from loader_service.config.feed import AUGMENTS, FIRST_SLOTS
from loader_service.config.loading import load_config
from loader_service.config.option import Option
from loader_service.config.options import FEED_OPTIONS, OPTIONS, FeedConfig, ServiceConfig
from loader_service.config.values import ConfigError

__all__ = [
    "AUGMENTS",
    "FEED_OPTIONS",
    "FIRST_SLOTS",
    "OPTIONS",
    "ConfigError",
    "FeedConfig",
    "Option",
    "ServiceConfig",
    "load_config",
]
