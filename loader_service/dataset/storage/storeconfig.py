"""How the service and its workers reach an object store: ``--storage-option`` pairs (secrets,
never logged), and the fetch cache's folder and size."""

from __future__ import annotations

from dataclasses import dataclass

CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "randomize_addresses",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
"""Storage options that configure obstore's HTTP client rather than the store."""

ENV_PREFIXES = {"s3": "AWS_", "gs": "GOOGLE_", "az": "AZURE_"}
"""How each store's environment variables begin (``AWS_ALLOW_HTTP``)."""


@dataclass(frozen=True)
class StorageConfig:
    """How the service and its workers reach the data's store, and where fetched data is kept."""

    options: tuple[tuple[str, str], ...] = ()
    """``--storage-option`` pairs, given to obstore (``CLIENT_KEYS`` to its HTTP client)."""
    cache_dir: str = ""
    """``--cache-dir``: fetched objects and saved indexes (``dataset.cachedir``); "" keeps nothing."""
    cache_size: int = 0
    """``--cache-size``: the most bytes of fetched objects ``cache_dir`` holds."""
    read_deadline: float = 10.0
    """Seconds a worker's reads for one task may take, retries included (half the task timeout)."""

    def __repr__(self) -> str:  # the values may be secrets
        keys = ", ".join(k for k, _ in self.options)
        return f"StorageConfig(options=[{keys}], cache_dir={self.cache_dir!r}, cache_size={self.cache_size})"
