"""Plain one-line-per-event logging that reads well in a terminal and in journald."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, role: str) -> None:
    """Set up this process's root logger; ``role`` names it in every line (``service``, ``worker-3``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {role}[%(process)d] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
