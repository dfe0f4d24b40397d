"""``--stop-with-stdin``: the service lives as long as whoever holds the other end of its stdin.

NOTE [ Stop with stdin ]
    A trainer that starts a private service (``ServiceLoader.local``) must not leave it behind
    however the trainer ends, SIGKILL and the OOM killer included, where no handler of its own
    runs. The kernel closes every descriptor of a process that ends, so the trainer keeps the
    write end of a pipe on the service's stdin and the service polls the read end beside its
    sockets: end of file means its starter is gone, and it stops as on SIGTERM (workers joined,
    segments and its ipc socket removed). Bytes written to the pipe are read and ignored. A
    parent-death signal would not do: it fires when the thread that started the child ends,
    not the process. Anything else the starter forked holds the write end too, so the service
    lives while any of them does.
"""

from __future__ import annotations

import os

READ_BYTES = 4096


class Lifeline:
    """The read end of the pipe on ``fd`` (stdin); ``cut`` says when its writers are all gone."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd

    def cut(self) -> bool:
        """Call when ``fd`` polls readable: True at end of file (or when it cannot be read)."""
        try:
            return os.read(self.fd, READ_BYTES) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
