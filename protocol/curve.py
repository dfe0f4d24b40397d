"""CURVE on a client's side (a trainer, ``loader-service status``): the keys a connection presents,
from arguments or the environment, and which tcp endpoints only this host can reach. Both the
trainer's package and the service use it.

A trainer needs the service's public key (``NAME.key``, to know it talks to the real service) and its
own key pair (``NAME.key_secret``, which the service must have authorised). ``DATAFERRY_SERVER_KEY``
and ``DATAFERRY_CLIENT_KEY`` name the two files when the code does not, so a torchrun job needs no
change. Without either, connections are plain: what an ipc:// or loopback endpoint expects.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth

log = logging.getLogger(__name__)
SERVER_KEY_ENV = "DATAFERRY_SERVER_KEY"
CLIENT_KEY_ENV = "DATAFERRY_CLIENT_KEY"


@dataclass(frozen=True, repr=False)  # no repr: it would print the secret key
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(
        cls, server_key: str | None, client_key: str | None, environ: Mapping[str, str] = os.environ
    ) -> ClientKeys | None:
        """The keys to present, or None for a plain connection; ValueError naming a bad file."""
        server = server_key or environ.get(SERVER_KEY_ENV, "")
        client = client_key or environ.get(CLIENT_KEY_ENV, "")
        if not server and not client:
            return None
        if not server or not client:
            raise ValueError(
                f"CURVE needs both keys: server_key (or {SERVER_KEY_ENV}) names the service's .key file, "
                f"client_key (or {CLIENT_KEY_ENV}) this trainer's .key_secret file"
            )
        server_public, _ = _read(server)
        public, secret = _read(client)
        if secret is None:
            raise ValueError(f"{client} holds no secret key: client_key is this trainer's .key_secret file")
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Call before ``connect``."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _read(path: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from None


def is_loopback(endpoint: str) -> bool:
    """A tcp:// endpoint only this host can reach: ``localhost`` or a loopback address. ``*``,
    0.0.0.0, interface names, other addresses and host names (another host, as far as this process
    can tell) are not; nor is an endpoint of another transport. The one rule for both sides: the
    service's warning on an unauthenticated bind and a trainer's on a connection in the clear."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def in_the_clear(endpoint: str, keys: ClientKeys | None) -> bool:
    """Would this connection carry batches unencrypted to another host (a tcp:// endpoint that is
    not loopback, without keys)?"""
    return keys is None and endpoint.startswith("tcp://") and not is_loopback(endpoint)


def warn_if_in_the_clear(endpoint: str, keys: ClientKeys | None) -> None:
    if in_the_clear(endpoint, keys):
        log.warning(
            "connecting to %s WITHOUT CURVE: every batch and message crosses the network unencrypted "
            "and unauthenticated (give server_key/client_key, or DATAFERRY_SERVER_KEY/DATAFERRY_CLIENT_KEY)",
            endpoint,
        )
