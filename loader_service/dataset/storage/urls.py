"""Where data is: an object store's URLs (``s3://``, ``gs://``, ``az://``), split and joined."""

from __future__ import annotations

from pathlib import Path

from loader_service.dataset.tables import DatasetError

STORE_SCHEMES = ("s3", "gs", "az")


def in_object_store(data: str | Path) -> bool:
    """Does ``data`` name an object store (``s3://``, ``gs://``, ``az://``)?"""
    scheme, sep, _ = str(data).partition("://")
    return bool(sep) and scheme.lower() in STORE_SCHEMES


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.tar`` -> (``s3://bucket``, ``a/b.tar``)."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise DatasetError(f"{url}: no bucket named (expected {scheme}://BUCKET/KEY)")
    return f"{scheme.lower()}://{bucket}", key


def join_url(root: str, name: str) -> str:
    """``name`` under the folder URL ``root``; a full URL stays itself."""
    if in_object_store(name):
        return name
    return root.rstrip("/") + "/" + name.lstrip("/")
