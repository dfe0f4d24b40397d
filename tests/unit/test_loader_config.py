"""``LoaderConfig`` and where a loader's endpoints come from: the code, or DATAFERRY_ENDPOINTS."""

from __future__ import annotations

import pytest

from gpu_worker.loader_config import ENDPOINTS_ENV, LoaderConfig, endpoints_of


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
