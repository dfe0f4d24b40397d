from __future__ import annotations

from pathlib import Path

import pytest

from loader_service.config import ConfigError, load_config


def test_file_then_flags_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "tcp://127.0.0.1:5555"\nbatch_size = 32\nworkers = 3\n'
    )
    cfg = load_config(cfg_file, {"batch_size": 16, "workers": None})
    assert cfg.batch_size == 16 and cfg.workers == 3 and cfg.data == tmp_path.resolve()
    assert cfg.pool_slots == 2 * 3 + 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("batch_sise = 3\n", "unknown keys.*batch_sise"),
        ('workers = "two"\n', "'workers' has the wrong type"),
        ("workers = true\n", "'workers' has the wrong type"),
        ("data = [\n", "cannot read config file"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(cfg_file, {"data": tmp_path, "endpoint": "tcp://127.0.0.1:1"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"endpoint": "tcp://127.0.0.1:1"}, "data is required"),
        ({"data": "DATA", "endpoint": "http://x"}, "endpoint must be"),
        ({"data": "DATA", "endpoint": "ipc:///" + "x" * 120}, "1 to 107 bytes"),
        ({"data": "DATA", "endpoint": "ipc:///no/such/dir/s.sock"}, "does not exist"),
        ({"data": "DATA", "endpoint": "tcp://h:1", "workers": 0}, "workers"),
        ({"data": "DATA", "endpoint": "tcp://h:1", "augment": "fancy"}, "augment"),
        ({"data": "DATA", "endpoint": "tcp://h:1", "image_size": 4}, "image_size"),
        ({"data": "DATA/nope", "endpoint": "tcp://h:1"}, "does not exist"),
    ],
)
def test_bad_values_are_refused(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    fixed = {k: (str(v).replace("DATA", str(tmp_path)) if k == "data" else v) for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=message):
        load_config(None, fixed)


def test_feed_tables_add_feeds_inheriting_top_level_values(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "tcp://127.0.0.1:5555"\nbatch_size = 32\nimage_size = 160\n'
        f'[feeds.val]\ndata = "{tmp_path}"\naugment = "eval"\nimage_size = 224\n'
    )
    train, val = load_config(cfg_file, {}).feeds()
    assert (train.name, train.batch_size, train.image_size, train.augment) == ("train", 32, 160, "train")
    assert (val.name, val.batch_size, val.image_size, val.augment) == ("val", 32, 224, "eval")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('augment = "eval"\n', "needs a data directory"),
        ('data = "DATA"\nbatch_sise = 3\n', r"unknown keys in \[feeds.val\]"),
        ('data = "DATA"\nbatch_size = "3"\n', "'batch_size' has the wrong type"),
        ('data = "DATA"\naugment = "fancy"\n', "feed 'val': augment"),
        ('data = "DATA/missing"\n', "does not exist"),
    ],
)
def test_bad_feed_tables_are_refused(tmp_path: Path, table: str, message: str) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "tcp://127.0.0.1:5555"\n[feeds.val]\n'
        + table.replace("DATA", str(tmp_path))
    )
    with pytest.raises(ConfigError, match=message):
        load_config(cfg_file, {})
