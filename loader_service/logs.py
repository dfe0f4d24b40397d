"""Plain one-line-per-event logging that reads well in a terminal and in journald."""

from __future__ import annotations

import logging
import sys

from protocol.printable import printable


def configure_logging(level: str, role: str) -> None:
    """Set up this process's root logger; ``role`` names it in every line (``service``, ``worker-3``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {role}[%(process)d] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class TextFormatter(logging.Formatter):
    """Every message as one line of text, whatever names it holds: a trainer's, a group's, a file's
    (NOTE [ Chosen names are shown as text ]); a traceback keeps its lines, each shown so."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's names)
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: logging._SysExcInfoType) -> str:  # noqa: N802
        return "\n".join(map(printable, super().formatException(ei).split("\n")))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return "\n".join(map(printable, stack_info.split("\n")))


class LogLimiter:
    """At most ``per_minute`` lines of one kind; then one line saying how many were left out.

    Hostile or broken traffic must not be able to flood the journal.
    """

    def __init__(self, what: str, per_minute: int) -> None:
        self.what = what
        self.per_minute = per_minute
        self._window_start = float("-inf")
        self._count = 0
        self._suppressed = 0

    def allow(self, now: float) -> bool:
        if now - self._window_start >= 60.0:
            if self._suppressed:
                logging.getLogger(__name__).warning(
                    "%d more %s in the last minute were not logged", self._suppressed, self.what
                )
            self._window_start, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count > self.per_minute:
            self._suppressed += 1
            return False
        return True
