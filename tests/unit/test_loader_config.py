"""``LoaderConfig`` and where a loader's endpoints come from: the code, or DATAFERRY_ENDPOINTS."""

from __future__ import annotations

import pytest

from gpu_worker.loader_config import ENDPOINTS_ENV, LoaderConfig, endpoints_of
from gpu_worker.names import name_of
from protocol.weights import MAX_EPOCH_SAMPLES


def test_one_endpoint_or_several_from_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    assert endpoints_of("ipc:///run/a.sock") == ("ipc:///run/a.sock",)
    assert endpoints_of(["ipc:///run/a.sock", "tcp://cpu-1:5555"]) == (
        "ipc:///run/a.sock",
        "tcp://cpu-1:5555",
    )
    with pytest.raises(ValueError, match=ENDPOINTS_ENV):
        endpoints_of(None)


def test_the_environment_takes_the_place_of_what_the_code_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINTS_ENV, " tcp://cpu-1:5555, tcp://cpu-2:5555 ,")
    assert endpoints_of("ipc:///run/a.sock") == ("tcp://cpu-1:5555", "tcp://cpu-2:5555")
    assert endpoints_of(None) == ("tcp://cpu-1:5555", "tcp://cpu-2:5555")


@pytest.mark.parametrize(
    ("endpoints", "mode", "message"),
    [
        ((), "shard", "give 1 to 64 endpoints"),
        (("ipc:///a", "http://b"), "shard", "endpoint must be ipc://PATH or tcp://HOST:PORT"),
        (("ipc:///a", "ipc:///a"), "shard", "named twice"),
        (("ipc:///a", "tcp://b:1"), "broadcast", "a broadcast group is fed by one service"),
    ],
)
def test_a_fleet_that_cannot_work_is_refused_before_any_connection(
    endpoints: tuple[str, ...], mode: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LoaderConfig(endpoints, mode=mode).validated()


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("tcp://loaders.train.svc.cluster.local:5555", "loaders.train.svc.cluster.local"),
        ("tcp://localhost:5555", "localhost"),
        ("tcp://127.0.0.1:5555", None),
        ("tcp://[::1]:5555", None),
        ("ipc:///run/dataferry/train.sock", None),
    ],
)
def test_an_endpoint_naming_a_host_is_a_name_to_follow(endpoint: str, host: str | None) -> None:
    """NOTE [ A fleet from a name ]: only a host name is looked up; addresses are used as given."""
    name = name_of(endpoint)
    assert (name.host if name else None) == host
    if name is not None:
        assert name.address("10.0.0.7") == "tcp://10.0.0.7:5555"


@pytest.mark.parametrize(
    "endpoint", ["tcp://loaders", "tcp://loaders:http", "tcp://loaders:0", "tcp://:5555"]
)
def test_a_tcp_endpoint_without_host_or_port_is_refused_before_any_lookup(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"tcp://HOST:PORT|names no host"):
        LoaderConfig((endpoint,)).validated()


@pytest.mark.parametrize("interval", [-1.0, 0.01, 7200.0])
def test_a_resolve_interval_out_of_range_is_refused(interval: float) -> None:
    with pytest.raises(ValueError, match="resolve_interval"):
        LoaderConfig(("tcp://loaders:5555",), resolve_interval=interval).validated()


@pytest.mark.parametrize(
    ("weights", "epoch_samples", "message"),
    [
        ((("a", 1.0), ("b", -1.0)), 0, "weight of 'b' must be a finite number >= 0"),
        ((("a", True),), 0, "weight of 'a' must be a finite number"),
        ((), 100, "epoch_samples goes with weights"),
        ((("a", 1.0),), MAX_EPOCH_SAMPLES + 1, f"epoch_samples is at most {MAX_EPOCH_SAMPLES}"),
    ],
)
def test_a_weighting_the_service_would_refuse_is_refused_in_the_trainer(
    weights: tuple[tuple[str, object], ...], epoch_samples: int, message: str
) -> None:
    """The rule is ``protocol.weights``, the service's own: nothing it would refuse reaches the wire."""
    config = LoaderConfig(("ipc:///a",), weights=weights, epoch_samples=epoch_samples)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        config.validated()
