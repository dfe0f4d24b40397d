"""Deployment: the systemd units as systemd would read them, sd_notify on real sockets, ``status``, metrics.

The units are checked on rendered copies whose ``ExecStart=`` names the console scripts installed
next to this interpreter, because ``systemd-analyze verify`` checks that the command exists.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpu_worker.metrics import MetricsUnavailable as TrainerMetricsUnavailable
from gpu_worker.metrics import TrainerMetrics
from loader_service.config import load_config
from loader_service.supervisor import systemd
from loader_service.supervisor.metrics import MetricsUnavailable, ServiceMetrics
from loader_service.supervisor.service import STOP_GRACE
from loader_service.tools.sample_data import make_sample_dataset
from loader_service.tools.status_view import main_status, query_status, render
from protocol.messages import Heartbeat, StatusReply, StatusRequest, decode, encode
from tests.helpers import REPO, ServiceFactory

pytestmark = pytest.mark.e2e

DEPLOY = REPO / "deploy"
INSTALLED_BIN = "/opt/dataferry/venv/bin/"
EXPOSURE_LIMIT = 4.0
ANALYZE_TIMEOUT = 60.0

SAMPLE_BODY: dict[str, Any] = {
    "uptime": 12.3,
    "attached": 2,
    "workers": 2,
    "worker_restarts": 0,
    "rejected_messages": 0,
    "worker_list": [
        {"worker": 0, "pid": 123, "task": 5, "ready": True, "decoded": 640, "images_per_second": 210.5},
        {"worker": 1, "pid": 124, "task": None, "ready": False, "decoded": 0, "images_per_second": 0.0},
    ],
    "feeds": [
        {
            "name": "train",
            "samples": 90,
            "slots": {"free": 8, "filling": 2, "ready": 0, "leased": 2},
            "decoded": 640,
            "images_per_second": 400.1,
            "batches": 80,
            "bad_files": 3,
            "recent_bad_files": ["a/1.jpg", "a/2.jpg", "a/3.jpg", "b/x.jpg"],
        }
    ],
    "sessions": [
        {
            "session": "ab12",
            "client": "host:123",
            "feed": "train",
            "mode": "shard",
            "rank": 0,
            "world_size": 1,
            "group": "",
            "epoch": 3,
            "delivered": 100,
            "leased": 2,
            "credits": 6,
            "lag": 4,
            "idle_seconds": 0.2,
        }
    ],
}


# --- the units --------------------------------------------------------------------------------


def installed_scripts() -> Path:
    """The folder holding the ``loader-service`` and ``gpu-worker`` console scripts of this interpreter."""
    folder = str(Path(sys.executable).parent)
    found = [shutil.which(name, path=folder) for name in ("loader-service", "gpu-worker")]
    if None in found:
        pytest.skip(f"console scripts not installed next to {sys.executable} (pip install -e .)")
    return Path(folder)


def render_units(dest: Path) -> None:
    """Copy both units into ``dest`` with ``ExecStart=`` naming the installed scripts."""
    bin_dir = f"{installed_scripts()}/"
    for unit in ("loader-service@.service", "gpu-worker@.service"):
        text = (DEPLOY / unit).read_text()
        assert INSTALLED_BIN in text, f"{unit} does not run the scripts from {INSTALLED_BIN}"
        (dest / unit).write_text(text.replace(INSTALLED_BIN, bin_dir))


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    return subprocess.run(
        ["systemd-analyze", *args],
        capture_output=True,
        text=True,
        timeout=ANALYZE_TIMEOUT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trivially valid unit: if systemd-analyze cannot check even this here, the tests skip."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    folder = tmp_path_factory.mktemp("canary")
    unit = folder / "dataferry-canary.service"
    unit.write_text(f"[Unit]\nDescription=canary\n\n[Service]\nExecStart={sys.executable} -V\n")
    return unit


def require_verify(canary: Path) -> None:
    result = analyze("verify", "--man=no", str(canary))
    if result.returncode != 0 or result.stdout or result.stderr:
        pytest.skip(f"systemd-analyze verify does not work here (on a trivial unit): {result.stderr[-500:]}")


def require_offline_security(canary: Path) -> None:
    result = analyze("security", "--offline=true", "--no-pager", str(canary))
    if "Overall exposure level" not in result.stdout:
        pytest.skip(f"systemd-analyze security --offline does not work here: {result.stderr[-500:]}")


def test_systemd_analyze_verify_prints_nothing_for_both_units(canary: Path, tmp_path: Path) -> None:
    require_verify(canary)
    render_units(tmp_path)
    units = [str(tmp_path / f"{name}@train.service") for name in ("loader-service", "gpu-worker")]
    result = analyze("verify", "--man=no", *units)
    # verify exits 0 on unknown keys and bad values: any output at all is a failure.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_loader_unit_exposure_is_at_most_4(canary: Path, tmp_path: Path) -> None:
    require_offline_security(canary)
    render_units(tmp_path)
    unit = str(tmp_path / "loader-service@train.service")
    threshold = f"--threshold={EXPOSURE_LIMIT * 10:.0f}"  # in tenths: 40 is an exposure level of 4.0
    result = analyze("security", "--offline=true", "--no-pager", threshold, unit)
    match = re.search(r"Overall exposure level for loader-service@train\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= EXPOSURE_LIMIT, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def unit_settings(unit: str) -> dict[str, list[str]]:
    """``Key=`` -> every value it is given in the unit (comments and sections ignored)."""
    settings: dict[str, list[str]] = {}
    for line in (DEPLOY / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_loader_unit_matches_how_the_service_runs_and_stops() -> None:
    s = unit_settings("loader-service@.service")
    assert s["ExecStart"] == [f"{INSTALLED_BIN}loader-service serve --config /etc/dataferry/%i.toml"]
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"] and s["KillMode"] == ["mixed"]
    assert s["RemoveIPC"] == ["no"] and "DynamicUser" not in s
    assert s["RuntimeDirectory"] == ["dataferry"] and s["RuntimeDirectoryMode"] == ["0750"]
    # room for the worker join (STOP_GRACE), then terminate and kill of stragglers and the cleanup
    assert float(s["TimeoutStopSec"][0]) >= 2 * STOP_GRACE
    assert s["Restart"] == ["on-failure"] and "StartLimitBurst" in s and "WatchdogSec" in s


def test_gpu_worker_unit_uses_the_endpoint_of_the_example_config(tmp_path: Path) -> None:
    s = unit_settings("gpu-worker@.service")
    assert "--endpoint ipc:///run/dataferry/%i.sock" in s["ExecStart"][0]
    example = (DEPLOY / "train.toml").read_text()
    assert 'endpoint = "ipc:///run/dataferry/train.sock"' in example


def test_example_config_is_accepted_by_the_service(tmp_path: Path) -> None:
    """Every key of deploy/train.toml is one the service knows (data and endpoint moved to tmp)."""
    (tmp_path / "data" / "cls").mkdir(parents=True)
    config = load_config(
        DEPLOY / "train.toml", {"data": tmp_path / "data", "endpoint": f"ipc://{tmp_path}/train.sock"}
    )
    assert config.workers == 8 and config.batch_size == 64


# --- sd_notify on real sockets ----------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound in tmp_path, named by ``$NOTIFY_SOCKET`` as systemd does."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_notify_without_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.ready("up") is False and systemd.status("x") is False and systemd.stopping() is False


def test_ready_status_and_stopping_send_one_datagram_each(notify_socket: socket.socket) -> None:
    assert systemd.ready("serving 'train'") is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving 'train'"
    assert systemd.status("2 trainers\nattached") is True
    assert notify_socket.recv(4096) == b"STATUS=2 trainers attached"
    assert systemd.stopping() is True
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_notify_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"dataferry-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready() is True
        assert sock.recv(4096) == b"READY=1"


def test_notify_to_a_missing_socket_fails_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert systemd.notify("READY=1") is False


def test_watchdog_pings_at_half_the_interval(notify_socket: socket.socket) -> None:
    watchdog = systemd.Watchdog({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert watchdog.enabled and watchdog.interval == 2.0
    assert watchdog.due(100.0)  # the first ping is due at once
    assert watchdog.ping(100.0) is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert not watchdog.due(101.9)
    assert watchdog.due(102.0)
    watchdog.ping(102.0)
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert not watchdog.due(103.0)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "soon"},
        {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"},
    ],
)
def test_watchdog_is_off_unless_it_is_meant_for_this_process(environ: Mapping[str, str]) -> None:
    if environ.get("WATCHDOG_PID") == str(os.getpid()):
        pytest.skip("this test runs as pid 1")
    watchdog = systemd.Watchdog(environ)
    assert not watchdog.enabled and watchdog.interval is None
    assert not watchdog.due(0.0) and not watchdog.due(1e9)


def test_watchdog_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.Watchdog().interval == 15.0


# --- status ---------------------------------------------------------------------------------------


def cells(line: str) -> list[str]:
    return line.split()


def table_row(text: str, first: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first]]
    assert len(rows) == 1, text
    return rows[0]


def test_render_shows_what_an_operator_looks_for() -> None:
    text = render(SAMPLE_BODY)
    assert "up 12.3 s" in text and "2 trainer(s) attached" in text and "0 worker restart(s)" in text
    header = table_row(text, "FEED")
    assert header[:5] == ["FEED", "SAMPLES", "IMAGES/S", "DECODED", "BATCHES"]
    assert header[5:9] == ["FREE", "FILLING", "READY", "LEASED"]
    assert table_row(text, "train") == cells("train 90 400.1 640 80 8 2 0 2 3")
    assert "a/2.jpg, a/3.jpg, b/x.jpg" in text and "a/1.jpg" not in text  # the last few bad files
    assert table_row(text, "WORKER") == ["WORKER", "PID", "READY", "TASK", "DECODED", "IMAGES/S"]
    assert table_row(text, "0") == cells("0 123 yes 5 640 210.5")
    assert table_row(text, "1") == cells("1 124 no - 0 0.0")
    assert table_row(text, "TRAINER")[-3:] == ["CREDITS", "LAG", "IDLE"]
    assert table_row(text, "ab12") == cells("ab12 host:123 train shard 0/1 3 100 2 6 4 0.2 s")


def test_render_copes_with_older_or_partial_bodies() -> None:
    text = render({"uptime": 7200, "feeds": [{"name": "val"}], "sessions": "?", "worker_list": [1, None]})
    assert "up 2 h 00 min" in text
    assert table_row(text, "val") == ["val", *["-"] * 9]
    assert "no trainers attached" in text and "no decode workers reported" in text
    assert "no feeds reported" in render({})


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[str]:
    """A ROUTER answering one status request with a heartbeat, a garbage frame, then the sample body."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    def serve() -> None:
        if router.poll(5000):
            rid, frame = router.recv_multipart()
            assert isinstance(decode(frame, (StatusRequest,)), StatusRequest)
            for reply in (encode(Heartbeat()), b"\xc1garbage", encode(StatusReply(SAMPLE_BODY))):
                router.send_multipart([rid, reply])

    thread = threading.Thread(target=serve)
    thread.start()
    yield endpoint
    thread.join(10)
    ctx.destroy(linger=0)


def test_query_status_skips_other_frames_until_the_reply(fake_service: str) -> None:
    assert query_status(fake_service, timeout=5.0) == SAMPLE_BODY


def test_main_status_json_is_sorted_and_indented(
    fake_service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_status(fake_service, as_json=True, timeout=5.0) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == SAMPLE_BODY
    assert out.startswith('{\n  "attached": 2,')


def test_status_of_a_missing_service_names_it_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    with pytest.raises(TimeoutError, match=re.escape(endpoint)):
        query_status(endpoint, timeout=0.2)
    assert main_status(endpoint, as_json=False, timeout=0.2) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no status reply from {endpoint} within 0.2 s" in captured.err
    assert main_status("carrier-pigeon://", as_json=False, timeout=0.2) == 1
    assert "invalid endpoint" in capsys.readouterr().err


def test_status_of_a_real_service(tmp_path: Path, start_service: ServiceFactory) -> None:
    data = tmp_path / "data"
    make_sample_dataset(data, classes=2, per_class=4, seed=3)
    service = start_service(data, workers=1, batch_size=4)
    deadline = time.monotonic() + 30
    while not (body := query_status(service.endpoint, timeout=10.0))["worker_list"][0]["ready"]:
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    text = render(body)
    assert table_row(text, "train")[:2] == ["train", "8"]
    assert table_row(text, "0")[2] == "yes"  # the worker's READY column
    assert "no trainers attached" in text and "1 decode worker(s)" in text
    assert service.stop() == 0


# --- metrics --------------------------------------------------------------------------------------


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample the registry exposes, keyed by (name, labels), parsed back from the text format."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_service_metrics_follow_the_status_body() -> None:
    pytest.importorskip("prometheus_client")
    metrics, other = ServiceMetrics(), ServiceMetrics()
    metrics.update(SAMPLE_BODY)
    samples = scrape(metrics.registry)
    train = frozenset({("feed", "train")})
    assert samples[("dataferry_decoded_images_total", train)] == 640
    assert samples[("dataferry_decode_images_per_second", train)] == 400.1
    assert samples[("dataferry_bad_files_total", train)] == 3
    assert samples[("dataferry_batches_total", train)] == 80
    for state, count in {"free": 8, "filling": 2, "ready": 0, "leased": 2}.items():
        assert samples[("dataferry_slots", train | {("state", state)})] == count
    assert samples[("dataferry_worker_restarts_total", frozenset())] == 0
    assert samples[("dataferry_trainers_attached", frozenset())] == 2
    assert samples[("dataferry_uptime_seconds", frozenset())] == 12.3
    assert samples[("dataferry_worker_decode_images_per_second", frozenset({("worker", "0")}))] == 210.5
    session = frozenset({("session", "ab12"), ("client", "host:123"), ("feed", "train")})
    assert samples[("dataferry_trainer_lag_batches", session)] == 4
    assert samples[("dataferry_trainer_credits", session)] == 6
    assert not any(name.startswith("dataferry_decoded") for name, _ in scrape(other.registry))

    metrics.update({**SAMPLE_BODY, "sessions": [], "worker_restarts": 1})  # the trainer left
    samples = scrape(metrics.registry)
    assert samples[("dataferry_worker_restarts_total", frozenset())] == 1
    assert not any(name.startswith("dataferry_trainer_") for name, _ in samples)


def test_ready_wait_histogram() -> None:
    pytest.importorskip("prometheus_client")
    metrics = ServiceMetrics()
    metrics.observe_ready_wait("train", 0.003)
    samples = scrape(metrics.registry)
    train = {("feed", "train")}
    assert samples[("dataferry_batch_ready_wait_seconds_bucket", frozenset(train | {("le", "0.0025")}))] == 0
    assert samples[("dataferry_batch_ready_wait_seconds_bucket", frozenset(train | {("le", "0.005")}))] == 1


def test_trainer_batch_wait_histogram_is_served_over_http() -> None:
    pytest.importorskip("prometheus_client")
    metrics = TrainerMetrics()
    for seconds in (0.0002, 0.003, 20.0):
        metrics.observe(seconds)
    samples = scrape(metrics.registry)

    def bucket(le: str) -> float:
        return samples[("dataferry_batch_wait_seconds_bucket", frozenset({("le", le)}))]

    assert [bucket(le) for le in ("0.0001", "0.00025", "0.005", "10.0", "+Inf")] == [0, 1, 2, 2, 3]
    metrics.start(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5) as response:
            assert b"dataferry_batch_wait_seconds_count 3.0" in response.read()
    finally:
        metrics.stop()


def test_metrics_without_prometheus_client_name_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(MetricsUnavailable, match="prometheus_client"):
        ServiceMetrics()
    with pytest.raises(TrainerMetricsUnavailable, match="pip install prometheus_client"):
        TrainerMetrics()
