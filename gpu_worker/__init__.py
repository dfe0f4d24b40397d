"""What a trainer imports: ``ServiceLoader`` attaches to a running loader service and yields batches."""

from gpu_worker.client import Batch, ServiceLoader
from gpu_worker.connection import ServiceError, ServiceTimeout

__all__ = ["Batch", "ServiceError", "ServiceLoader", "ServiceTimeout"]
__version__ = "0.1.0"
