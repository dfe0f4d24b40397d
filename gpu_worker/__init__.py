"""What a trainer imports: ``ServiceLoader`` attaches to a running loader service and yields batches.

The names are looked up on first use, so that importing one of this package's light modules (the
runner's command line, a tool) does not import torch and the whole client with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.batch import Batch
    from gpu_worker.client import ServiceLoader
    from gpu_worker.connection import ServiceError, ServiceTimeout

__all__ = ["Batch", "ServiceError", "ServiceLoader", "ServiceTimeout"]
__version__ = "0.1.0"
_WHERE = {
    "Batch": "gpu_worker.batch",
    "ServiceLoader": "gpu_worker.client",
    "ServiceError": "gpu_worker.connection",
    "ServiceTimeout": "gpu_worker.connection",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ImportError(
            f"gpu_worker.{name} needs torch, which is not installed here: install a CPU or CUDA build "
            "of torch >= 2.1 (pip install 'dataferry[trainer]' takes PyPI's); a service host needs none"
        ) from exc
