"""What Hugging Face ``datasets`` writes into a table's schema (Parquet's and Arrow's alike): its
features, under the schema metadata's ``huggingface`` key, which say which column is an ``Image``
and which label is a ``ClassLabel`` with names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from loader_service.dataset.tables import DatasetError

HF_KEY = b"huggingface"


def hf_features(metadata: Mapping[bytes, bytes], where: str) -> dict[str, Any]:
    """The features ``datasets`` wrote in the file's metadata; {} if it wrote none we can read."""
    try:
        info = json.loads(metadata.get(HF_KEY, b"{}"))
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    except RecursionError:  # the file's writer decides how deep its JSON goes
        raise DatasetError(
            f"{where}: its {HF_KEY.decode()} metadata is nested too deeply to read; "
            "rewrite the file without it"
        ) from None
    return features if isinstance(features, dict) else {}


def is_image(feature: Any) -> bool:
    return isinstance(feature, dict) and feature.get("_type") == "Image"


def is_binary(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))
