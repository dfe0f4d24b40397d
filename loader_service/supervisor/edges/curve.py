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
ZAP_DOMAIN = b"dataferry"


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
        """Read the folder again; return how many keys are allowed now.

        Fails closed: a key file that cannot be read is skipped (and logged), never a reason to keep
        the old set, in which a key just removed would still be allowed; a folder that cannot be
        read allows nobody until it can.
        """
        try:
            files = sorted(path for path in self._folder.iterdir() if path.suffix == ".key")
        except OSError as exc:
            log.error("cannot read authorised trainer keys from %s: allowing none: %s", self._folder, exc)
            files = []
        keys = set()
        for path in files:
            try:
                public, _secret = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError) as exc:
                log.error("skipping trainer key %s: %s", path, exc)
                continue
            keys.add(public)
        self._keys = frozenset(keys)
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
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=self.keys)

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Call before ``bind``: the handshake settings apply to connections made after them."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        sock.curve_server = True
        # With a ZAP domain that libzmq must enforce, a handshake fails when no ZAP handler answers
        # (its thread died, or was never started); without one, CURVE would admit any key then.
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def stop(self) -> None:
        self._auth.stop()
