"""CURVE on the trainer endpoint: the service's key pair, the trainers let in, and refusals logged.

ZeroMQ runs the CURVE handshake itself and asks a ZAP handler (pyzmq's ``ThreadAuthenticator``, on
its own thread) whether the client's public key may connect. A refused peer never gets a
connection the main loop can see: it costs the handshake and nothing more, and it gets no reply.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from loader_service.logs import LogLimiter

log = logging.getLogger(__name__)


class TrainerKeys:
    """The public keys of trainers allowed in: the ``*.key`` files of one folder, re-read on demand.

    pyzmq calls ``callback`` from its authenticator thread; the key set is replaced whole, never
    mutated, so that thread always sees a complete set.
    """

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._keys: frozenset[bytes] = frozenset()
        self._lock = threading.Lock()
        self._refusals = LogLimiter("refused CURVE keys", per_minute=30)
        self.refused = 0

    def reload(self) -> int:
        """Read the folder again; return how many keys are allowed now."""
        try:
            keys = frozenset(zmq.auth.load_certificates(str(self._folder)))
        except (OSError, ValueError) as exc:
            log.error(
                "cannot read authorised trainer keys from %s (keeping the old set): %s", self._folder, exc
            )
            return len(self._keys)
        self._keys = keys
        log.info("CURVE: %d trainer keys allowed (from %s)", len(keys), self._folder)
        return len(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        with self._lock:
            self.refused += 1
            if self._refusals.allow(time.monotonic()):
                log.warning(
                    "refused a peer whose CURVE key is not authorised: %s", key.decode("ascii", "replace")
                )
        return False


class CurveGuard:
    """Turns a socket into a CURVE server that admits only the keys in ``authorized``."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], secret_file: Path, authorized: Path) -> None:
        public, secret = zmq.auth.load_certificate(str(secret_file))
        if secret is None:  # checked at config time too; a file can change before start
            raise ValueError(f"{secret_file} holds no secret key")
        self._public, self._secret = public, secret
        self.keys = TrainerKeys(authorized)
        self.keys.reload()
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self.keys)

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Call before ``bind``: the handshake settings apply to connections made after them."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()
