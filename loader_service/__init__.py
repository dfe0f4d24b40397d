"""The dataferry loader service: decode workers filling shared-memory batch slots, served over ZeroMQ."""

__version__ = "0.1.0"
