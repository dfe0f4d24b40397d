"""The deploy/ folder read as files: what the systemd units say, and that the example config loads.

Nothing here runs systemd or the service; ``tests/e2e/test_deploy.py`` checks the units with
``systemd-analyze``.
"""

from __future__ import annotations

from pathlib import Path

from loader_service.config import load_config
from loader_service.supervisor.service import STOP_GRACE
from tests.helpers import REPO

DEPLOY = REPO / "deploy"


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
    assert s["ExecStart"] == ["/opt/dataferry/venv/bin/loader-service serve --config /etc/dataferry/%i.toml"]
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
    assert config.workers == 0 and config.batch_size == 64, "workers: auto, sized by the service"


def test_secrets_go_where_only_root_reads_them_not_in_the_trainers_toml() -> None:
    """The TOML file is installed readable by the trainers' group; an object store's keys go in
    the file the unit loads as root (EnvironmentFile=), installed 0600 with no group."""
    s = unit_settings("loader-service@.service")
    assert s["EnvironmentFile"] == ["-/etc/dataferry/%i.env"]
    guide = (DEPLOY / "README.md").read_text()
    installs = [line.split("#")[0].split() for line in guide.splitlines() if "install -m" in line]
    env = next(words for words in installs if words[-1] == "/etc/dataferry/train.env")
    assert env[env.index("-m") + 1] == "0600" and "-g" not in env
    toml = next(words for words in installs if words[-1] == "/etc/dataferry/train.toml")
    assert toml[toml.index("-g") + 1] == "dataferry", "the trainers' group reads the TOML file..."
    example = (DEPLOY / "train.toml").read_text()
    assert "[storage]" not in example and "secret" not in example.lower().replace("no secrets", ""), (
        "... so it holds no secret"
    )
