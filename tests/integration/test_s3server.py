"""The S3 test server (testkit/s3server.py) against obstore: reads, refusals, crashes and a clean stop."""

from __future__ import annotations

import asyncio
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from obstore.store import RetryConfig

    from testkit.s3server import S3Server

pytestmark = pytest.mark.integration

obstore = pytest.importorskip("obstore", reason="pip install obstore (the S3 tests use it as the client)")
from obstore.exceptions import GenericError, PermissionDeniedError  # noqa: E402
from obstore.store import S3Store, from_url  # noqa: E402

# A client that fails at once while the server is down, rather than retrying for seconds.
NO_RETRIES: RetryConfig = {"max_retries": 0, "retry_timeout": timedelta(seconds=1)}


def test_upload_then_ranged_reads(s3_server: S3Server, tmp_path: Path) -> None:
    payload = os.urandom(300_000)
    (tmp_path / "blob.bin").write_bytes(payload)
    s3_server.upload(tmp_path / "blob.bin", "ranged/blob.bin")
    store = s3_server.store()

    assert bytes(obstore.get_range(store, "ranged/blob.bin", start=1000, end=1100)) == payload[1000:1100]
    parts = obstore.get_ranges(store, "ranged/blob.bin", starts=[0, 250_000], lengths=[10, 50_000])
    assert [bytes(p) for p in parts] == [payload[:10], payload[250_000:300_000]]

    async def read_async() -> bytes:
        return bytes(await obstore.get_range_async(store, "ranged/blob.bin", start=5, length=7))

    assert asyncio.run(read_async()) == payload[5:12]
    meta = obstore.head(store, "ranged/blob.bin")
    assert meta["size"] == len(payload)
    assert meta["path"] == "ranged/blob.bin"
    assert meta["e_tag"]


def test_upload_tree_and_delete(s3_server: S3Server, tmp_path: Path) -> None:
    for name in ["a/1.jpg", "a/2.jpg", "b/c/3.jpg"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    keys = s3_server.upload_tree(tmp_path, "tree/")
    assert keys == ["tree/a/1.jpg", "tree/a/2.jpg", "tree/b/c/3.jpg"]
    store = s3_server.store(prefix="tree")
    listed = sorted(meta["path"] for batch in obstore.list(store) for meta in batch)
    assert listed == ["a/1.jpg", "a/2.jpg", "b/c/3.jpg"]

    s3_server.delete("tree/a/2.jpg")
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "a/2.jpg")


def test_bad_credentials_are_refused(s3_server: S3Server) -> None:
    obstore.put(s3_server.store(), "auth/object", b"secret data")
    wrong_secret = s3_server.store(secret_key="not-the-secret")
    with pytest.raises(PermissionDeniedError):
        obstore.get(wrong_secret, "auth/object")
    with pytest.raises(PermissionDeniedError):
        obstore.put(wrong_secret, "auth/other", b"x")
    with pytest.raises(PermissionDeniedError):
        obstore.get(s3_server.store(access_key="nobody"), "auth/object")
    anonymous = S3Store(
        s3_server.bucket,
        endpoint=s3_server.endpoint,
        skip_signature=True,
        client_options={"allow_http": True},
    )
    with pytest.raises(PermissionDeniedError):
        obstore.get(anonymous, "auth/object")


def test_missing_objects_and_buckets_are_file_not_found(s3_server: S3Server) -> None:
    # obstore raises the builtin FileNotFoundError for a 404, not obstore.exceptions.NotFoundError.
    with pytest.raises(FileNotFoundError):
        obstore.get(s3_server.store(), "missing/object")
    with pytest.raises(FileNotFoundError):
        obstore.head(s3_server.store(), "missing/object")
    with pytest.raises(FileNotFoundError):  # no auto-created buckets, as on real S3
        obstore.put(s3_server.store(bucket="no-such-bucket"), "x", b"x")


def test_env_alone_configures_obstore(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    obstore.put(s3_server.store(), "env/prefix/object", b"via env")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    assert bytes(obstore.get(from_url(f"s3://{s3_server.bucket}/env/prefix"), "object").bytes()) == b"via env"
    assert bytes(obstore.get(S3Store(s3_server.bucket), "env/prefix/object").bytes()) == b"via env"


def test_kill_and_restart_keep_objects(fresh_s3_server: S3Server) -> None:
    server = fresh_s3_server
    obstore.put(server.store(), "durable/object", b"still here")
    endpoint, pid = server.endpoint, server.pid
    assert pid is not None

    server.kill()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with pytest.raises(GenericError, match="error sending request"):  # connection refused
        obstore.get(server.store(retry_config=NO_RETRIES), "durable/object")

    server.restart()
    assert server.endpoint == endpoint
    assert bytes(obstore.get(server.store(), "durable/object").bytes()) == b"still here"
    obstore.put(server.store(), "durable/after", b"new")
    assert bytes(obstore.get(server.store(), "durable/after").bytes()) == b"new"


def test_stop_is_clean(fresh_s3_server: S3Server) -> None:
    server = fresh_s3_server
    pid = server.pid
    assert pid is not None and server.running
    server.stop()
    assert not server.running
    assert server.proc is not None and server.proc.returncode == 0  # exited on SIGTERM, not killed
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with socket.socket() as probe:
        # SO_REUSEADDR as servers set it: the closed connections leave the port in TIME_WAIT.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", server.port))  # nothing listens on its port any more
    assert not list(Path("/tmp").glob(f"seaweedfs-*-{server.port}.sock"))
    server.stop()  # a second stop is harmless
