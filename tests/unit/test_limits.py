"""Per-connection limits and the endpoint security rules, without sockets."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq.auth

from loader_service.config import ConfigError, load_config
from loader_service.supervisor.trainers.limits import RateGate
from loader_service.tools.keys import KeysError, make_keys
from protocol.curve import ClientKeys, in_the_clear, is_loopback


def test_many_connections_together_stay_within_the_loops_budget() -> None:
    """Fifty connections used to get fifty times the per-connection rate."""
    gate = RateGate(rate=1000.0, burst=2000.0, all_rate=20_000.0, all_burst=40_000.0)
    admitted = sum(gate.admit(b"peer-%d" % peer, 100.0) for peer in range(50) for _ in range(2000))
    assert admitted == 40_000, "the burst over all connections, not 50 x 2000"
    assert not gate.admit(b"peer-49", 100.0), "a connection with its own burst left is refused too"
    assert gate.admit(b"trainer", 100.0, established=True), "one that carries a session is not starved"
    assert gate.admit(b"peer-49", 100.01), "and the others are served again as the budget refills"


def test_a_connection_over_its_rate_is_dropped_and_recovers() -> None:
    gate = RateGate(rate=10.0, burst=5.0)
    assert all(gate.admit(b"a", 0.0) for _ in range(5))
    assert not gate.admit(b"a", 0.0), "the burst is spent"
    assert gate.admit(b"b", 0.0), "another connection has its own bucket"
    assert gate.admit(b"a", 0.1), "one token back after 1/rate seconds"
    assert gate.dropped == 1


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.9.9.9:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_loopback_endpoints(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def config(tmp_path: Path, **flags: object) -> object:
    return load_config(None, {"data": str(tmp_path), **flags}, environ={})


def test_a_network_endpoint_needs_curve_or_an_explicit_opt_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="loader-service keys --out DIR"):
        config(tmp_path, endpoint="tcp://0.0.0.0:5555")
    config(tmp_path, endpoint="tcp://0.0.0.0:5555", insecure_tcp=True)


def test_loopback_tcp_follows_the_same_rule_since_every_local_user_reaches_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="can be reached by every user of this host"):
        config(tmp_path, endpoint="tcp://127.0.0.1:5555")
    config(tmp_path, endpoint="tcp://127.0.0.1:5555", insecure_tcp=True)


def test_curve_options_go_together_and_must_name_real_keys(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys", "svc")
    trainers = tmp_path / "trainers"
    trainers.mkdir()
    with pytest.raises(ConfigError, match="go together"):
        config(tmp_path, endpoint="tcp://0.0.0.0:1", curve_secret_key=str(keys.secret))
    with pytest.raises(ConfigError, match="holds no secret key"):
        config(
            tmp_path,
            endpoint="tcp://0.0.0.0:1",
            curve_secret_key=str(keys.public),
            curve_authorized=str(trainers),
        )
    with pytest.raises(ConfigError, match="not a folder"):
        config(
            tmp_path,
            endpoint="tcp://0.0.0.0:1",
            curve_secret_key=str(keys.secret),
            curve_authorized=str(keys.public),
        )
    config(
        tmp_path,
        endpoint="tcp://0.0.0.0:1",
        curve_secret_key=str(keys.secret),
        curve_authorized=str(trainers),
    )


def test_keys_are_pyzmq_certificates_with_a_private_secret(tmp_path: Path) -> None:
    pair = make_keys(tmp_path, "trainer-1")
    public, secret = zmq.auth.load_certificate(str(pair.secret))
    assert secret is not None and zmq.auth.load_certificate(str(pair.public)) == (public, None)
    assert stat.S_IMODE(os.stat(pair.secret).st_mode) == 0o600
    with pytest.raises(KeysError, match="refusing to overwrite"):
        make_keys(tmp_path, "trainer-1")
    assert zmq.auth.load_certificate(str(pair.secret))[1] == secret, "the old key is untouched"


@pytest.mark.parametrize(
    ("endpoint", "clear"),
    [
        ("tcp://10.1.2.3:5555", True),
        ("tcp://loader-host:5555", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://[::1]:5555", False),
        ("tcp://localhost:5555", False),
        ("ipc:///run/dataferry/train.sock", False),
    ],
)
def test_a_trainer_says_so_when_it_would_send_in_the_clear_to_another_host(
    endpoint: str, clear: bool
) -> None:
    assert in_the_clear(endpoint, None) is clear
    keys = ClientKeys(b"s" * 40, b"p" * 40, b"k" * 40)
    assert in_the_clear(endpoint, keys) is False


def test_large_messages_cost_by_their_size() -> None:
    """A session's maximal releases (37 KB, 200 us each to decode) at the message rate would keep
    the loop's core busy: each costs one more message per 256 bytes, small ones one."""
    gate = RateGate(rate=1000.0, burst=2000.0)
    big, cost = 36_939, 1 + 36_939 // 256
    admitted = sum(gate.admit(b"s", 0.0, established=True, size=big) for _ in range(100))
    assert admitted == 2000 // cost == 13, "the burst pays for 13 of them, not 100"
    later = sum(gate.admit(b"s", 1.0, established=True, size=big) for _ in range(100))
    assert later == (2000 - 13 * cost + 1000) // cost == 7, "then about 7 a second, not 1000"
    assert gate.admit(b"t", 1.0, established=True, size=82), "a release of one lease costs one"
    small = sum(gate.admit(b"u", 1.0, established=True, size=200) for _ in range(3000))
    assert small == 2000
