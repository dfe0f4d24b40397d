from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from loader_service.config import (
    FEED_OPTIONS,
    FIRST_SLOTS,
    OPTIONS,
    ConfigError,
    Option,
    ServiceConfig,
    load_config,
)
from loader_service.config.feed import AUTO_MOST_SLOTS
from loader_service.config.values import ByteSize, WorkerCount, parse_bytes
from loader_service.decode import decoders
from loader_service.tools.cli import build_parser


def test_file_then_flags_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\nbatch_size = 32\nworkers = 3\n'
    )
    cfg = load_config(cfg_file, {"batch_size": 16, "workers": None})
    assert cfg.batch_size == 16 and cfg.workers == 3 and cfg.data == str(tmp_path.resolve())
    assert (cfg.feeds()[0].slots, cfg.feeds()[0].first_slots) == (AUTO_MOST_SLOTS, FIRST_SLOTS)
    many = load_config(cfg_file, {"workers": "auto", "max_workers": 200})
    assert many.feeds()[0].slots == 2 * 200 + 8, "every worker filling one, as many ready"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("batch_sise = 3\n", "unknown keys.*batch_sise"),
        ('workers = "two"\n', "'workers' must be \"auto\" or a whole number"),
        ("workers = true\n", "'workers' must be \"auto\" or a whole number"),
        ("data = [\n", "cannot read config file"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(cfg_file, {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"endpoint": "ipc:///tmp/feed.sock"}, "data is required"),
        ({"data": "DATA", "endpoint": "http://x"}, "endpoint must be"),
        ({"data": "DATA", "endpoint": "ipc:///" + "x" * 120}, "1 to 107 bytes"),
        ({"data": "DATA", "endpoint": "ipc:///no/such/dir/s.sock"}, "does not exist"),
        ({"data": "DATA", "endpoint": "tcp://h:1", "workers": -1}, "workers"),
        ({"data": "DATA", "endpoint": "tcp://h:1", "cpu_budget": -1.0}, "cpu_budget"),
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
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\nbatch_size = 32\nimage_size = 160\n'
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
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n[feeds.val]\n'
        + table.replace("DATA", str(tmp_path))
    )
    with pytest.raises(ConfigError, match=message):
        load_config(cfg_file, {})


# --- the environment layer -------------------------------------------------------------------------


def base_env(tmp_path: Path) -> dict[str, str]:
    return {"DATAFERRY_DATA": str(tmp_path), "DATAFERRY_ENDPOINT": "ipc:///tmp/feed.sock"}


@pytest.mark.parametrize(
    ("variable", "text", "field", "value"),
    [
        ("DATAFERRY_WORKERS", "8", "workers", WorkerCount(8)),
        ("DATAFERRY_WORKERS", "auto", "workers", WorkerCount(0)),
        ("DATAFERRY_BATCH_SIZE", " 16 ", "batch_size", 16),
        ("DATAFERRY_LAG_TIMEOUT", "2.5", "lag_timeout", 2.5),
        ("DATAFERRY_TASK_TIMEOUT", "60", "task_timeout", 60.0),
        ("DATAFERRY_STRICT", "1", "strict", True),
        ("DATAFERRY_STRICT", "true", "strict", True),
        ("DATAFERRY_STRICT", "0", "strict", False),
        ("DATAFERRY_STRICT", "FALSE", "strict", False),
        ("DATAFERRY_AUGMENT", "eval", "augment", "eval"),
        ("DATAFERRY_GROUP", "", "group", ""),
    ],
)
def test_environment_values_are_read_as_the_option_type(
    tmp_path: Path, variable: str, text: str, field: str, value: object
) -> None:
    cfg = load_config(None, {}, environ={**base_env(tmp_path), variable: text})
    assert getattr(cfg, field) == value and type(getattr(cfg, field)) is type(value)
    assert cfg.data == str(tmp_path.resolve()) and cfg.endpoint == "ipc:///tmp/feed.sock"


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("DATAFERRY_WORKERS", "eight"),
        ("DATAFERRY_WORKERS", "8.0"),
        ("DATAFERRY_CLIENT_TIMEOUT", "soon"),
        ("DATAFERRY_STRICT", "maybe"),
        ("DATAFERRY_DATA", ""),
        ("DATAFERRY_WORKERS", "-1"),  # well typed, refused by the check: still says who set it
        ("DATAFERRY_AUGMENT", "fancy"),
        ("DATAFERRY_LAG_TIMEOUT", "inf"),
    ],
)
def test_bad_environment_values_name_the_variable(tmp_path: Path, variable: str, text: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        load_config(None, {}, environ={**base_env(tmp_path), variable: text})


def test_other_dataferry_variables_are_not_options(tmp_path: Path) -> None:
    environ = {**base_env(tmp_path), "DATAFERRY_INJECT_FAULT": "main-loop", "DATAFERRY_NO_SUCH": "x"}
    assert load_config(None, {}, environ=environ).workers == 0  # auto


@pytest.mark.parametrize(
    ("in_file", "in_env", "flag", "expected"),
    [
        (False, False, None, 0),
        (True, False, None, 3),
        (True, True, None, 5),
        (False, True, None, 5),
        (True, True, 7, 7),
    ],
)
def test_precedence_is_defaults_file_environment_flags(
    tmp_path: Path, in_file: bool, in_env: bool, flag: int | None, expected: int
) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n' + "workers = 3\n" * in_file
    )
    environ = {"DATAFERRY_WORKERS": "5"} if in_env else {}
    assert load_config(cfg_file, {"workers": flag}, environ=environ).workers == expected


def test_errors_say_which_layer_set_the_bad_value(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\nworkers = -2\n')
    with pytest.raises(ConfigError, match=r"workers must be at least 0 \(set by .*svc.toml\)"):
        load_config(cfg_file, {}, environ={})
    with pytest.raises(ConfigError, match=r"workers must be at least 0 \(set by --workers\)"):
        load_config(cfg_file, {"workers": -1}, environ={"DATAFERRY_WORKERS": "4"})


# --- each option declared once ---------------------------------------------------------------------


def sample_flag(opt: Option) -> tuple[list[str], object]:
    """Words after the flag on a command line, and the value argparse should make of them."""
    text = opt.choices[-1] if opt.choices else "x"
    samples: dict[type, tuple[list[str], object]] = {
        int: (["7"], 7),
        float: (["2.5"], 2.5),
        str: ([text], text),
        Path: (["some/dir"], Path("some/dir")),
        bool: ([], True),
        ByteSize: (["3G"], 3 * 2**30),
        WorkerCount: (["auto"], 0),
    }
    return samples[opt.type]


def test_every_field_is_an_option_with_a_flag_an_env_name_and_help() -> None:
    # Not options: further feeds, the fields a pipeline returns (config-file tables only), and the
    # storage settings and named sources (each a repeatable flag and a table of their own).
    not_options = {"extra_feeds", "fields", "storage_options", "sources"}
    assert {f.name for f in fields(ServiceConfig)} - not_options == set(OPTIONS)
    argv = ["serve"]
    expected: dict[str, object] = {}
    for opt in OPTIONS.values():
        words, expected[opt.name] = sample_flag(opt)
        argv += [opt.flag, *words]
        assert opt.help and opt.env == "DATAFERRY_" + opt.name.upper()
    args = build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in OPTIONS} == expected


def test_flags_not_given_leave_the_lower_layers_alone(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--no-strict"])
    overrides = {name: getattr(args, name) for name in OPTIONS}
    assert overrides.pop("strict") is False
    assert set(overrides.values()) == {None}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--augment", "fancy"])  # choices come from the declaration


def test_feed_tables_accept_exactly_the_feed_options(tmp_path: Path) -> None:
    assert set(FEED_OPTIONS) == {
        "data", "format", "image_column", "label_column", "label_offset", "pipeline", "batch_size",
        "image_size", "augment", "interpolation", "encoded_row_bytes", "seed", "slots", "cache_memory",
        "pipeline_deterministic"
    }  # fmt: skip
    table = f'data = "{tmp_path}"\nbatch_size = 8\nimage_size = 32\naugment = "none"\nseed = 3\nslots = 4\n'
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n[feeds.x]\n{table}')
    _, x = load_config(cfg_file, {}, environ={}).feeds()
    assert (x.name, x.batch_size, x.image_size, x.augment, x.seed, x.slots) == ("x", 8, 32, "none", 3, 4)
    for name in set(OPTIONS) - set(FEED_OPTIONS):
        cfg_file.write_text(
            f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n[feeds.x]\n{table}{name} = 1\n'
        )
        with pytest.raises(ConfigError, match=rf"unknown keys in \[feeds.x\]: {name}"):
            load_config(cfg_file, {}, environ={})


def test_feed_slots_are_not_inherited_and_zero_means_auto(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\nworkers = 4\nslots = 30\n'
        f'[feeds.x]\ndata = "{tmp_path}"\n[feeds.y]\ndata = "{tmp_path}"\nslots = 0\n'
    )
    main, x, y = load_config(cfg_file, {}, environ={}).feeds()
    assert (main.slots, main.first_slots) == (30, 30)  # given: all reserved at start
    auto = AUTO_MOST_SLOTS
    assert (x.slots, x.first_slots, y.slots, y.first_slots) == (auto, FIRST_SLOTS, auto, FIRST_SLOTS)


@pytest.mark.parametrize(
    ("key", "value"),
    [("batch_size", 0), ("image_size", 4096), ("augment", "fancy"), ("seed", -1), ("slots", 5000)],
)
def test_feed_tables_are_checked_like_the_top_level(tmp_path: Path, key: str, value: object) -> None:
    base = {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"}
    with pytest.raises(ConfigError) as top:
        load_config(None, {**base, key: value}, environ={})
    top_message = str(top.value).removesuffix(f" (set by {OPTIONS[key].flag})")
    cfg_file = tmp_path / "svc.toml"
    toml_value = f'"{value}"' if isinstance(value, str) else value
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n'
        f'[feeds.x]\ndata = "{tmp_path}"\n{key} = {toml_value}\n'
    )
    with pytest.raises(ConfigError) as feed:
        load_config(cfg_file, {}, environ={})
    assert str(feed.value) == f"feed 'x': {top_message}"


def _config(tmp_path: Path, text: str) -> ServiceConfig:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(text)
    return load_config(cfg_file, {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"})


def test_pipelines_and_their_fields_come_from_the_file_per_feed(tmp_path: Path) -> None:
    (tmp_path / "aug.py").write_text("def make(sample, rng):\n    return {}\n")
    cfg = _config(
        tmp_path,
        f'pipeline = "{tmp_path}/aug.py:make"\n'
        '[fields]\nimage = { dtype = "float16", shape = [3, 8, 8] }\n'
        'label = { dtype = "int64", shape = [] }\n'
        f'[feeds.val]\ndata = "{tmp_path}"\nformat = "list"\npipeline = "mypackage.aug:evaluate"\n'
        '[feeds.val.fields]\nimage = { dtype = "uint8", shape = [3, 8, 8] }\n',
    )
    main, val = cfg.feeds()
    assert main.pipeline == f"{tmp_path.resolve()}/aug.py:make"
    assert [(f.name, f.dtype, f.shape) for f in main.fields] == [
        ("image", "float16", (3, 8, 8)),
        ("label", "int64", ()),
    ]
    assert val.format == "list" and val.pipeline == "mypackage.aug:evaluate"
    assert [(f.name, f.dtype, f.shape) for f in val.fields] == [("image", "uint8", (3, 8, 8))]


def test_a_relative_pipeline_file_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "aug.py").write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock", "pipeline": "aug.py:make"})
    assert cfg.pipeline == f"{tmp_path.resolve()}/aug.py:make"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[fields]\nx = { dtype = "int64", shape = [] }\n', "give pipeline too"),
        ('pipeline = "m:f"\n[fields]\nx = { dtype = "complex64", shape = [] }\n', "dtype 'complex64'"),
        ('pipeline = "m:f"\n[fields]\nx = { dtype = "int64" }\n', "shape"),
        ('pipeline = "m:f"\n[fields]\nx = "int64"\n', "x must be"),
        ('pipeline = "m:f"\n[fields]\n"1x" = { dtype = "int64", shape = [] }\n', "field name"),
        ('pipeline = "m:f"\nfields = 3\n', "table of one or more fields"),
        ('pipeline = "not a spec"\n', "FILE.py:FUNC or package.module:FUNC"),
        ('pipeline = "/no/such/file.py:f"\n', "does not exist"),
        ('format = "rar"\n', "format must be one of"),
    ],
)
def test_bad_pipelines_formats_and_fields_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, text)


def test_a_shard_pattern_needs_only_its_folder(tmp_path: Path) -> None:
    pattern = tmp_path / "train-{000000..000009}.tar"
    cfg = load_config(None, {"data": pattern, "endpoint": "ipc:///tmp/feed.sock"})
    assert cfg.data == str(pattern.resolve())
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, {"data": tmp_path / "nope" / "x-{0..1}.tar", "endpoint": "ipc:///tmp/feed.sock"})


def test_feed_tables_do_not_take_over_the_top_level_pipeline_or_format(tmp_path: Path) -> None:
    """[feeds.val] with augment = "eval" under a top-level training pipeline must run eval, not the
    training pipeline; and its data, not the first feed's, says its format."""
    cfg = _config(
        tmp_path,
        'pipeline = "mypackage.aug:train"\nformat = "imagefolder"\n'
        '[fields]\nimage = { dtype = "float16", shape = [3, 8, 8] }\n'
        f'[feeds.val]\ndata = "{tmp_path}"\naugment = "eval"\n',
    )
    main, val = cfg.feeds()
    assert (main.pipeline, main.format) == ("mypackage.aug:train", "imagefolder")
    assert (val.pipeline, val.format, val.augment, val.fields) == ("", "auto", "eval", ())


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1000000", 1000000), ("64G", 64 * 2**30), ("512m", 512 * 2**20), ("1.5T", 3 * 2**39),
     ("2GiB", 2 * 2**30), ("4 KB", 4096)],
)  # fmt: skip
def test_cache_sizes_take_binary_suffixes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "G", "12Q", "-1G", "lots", "1e30", "0.5", "1.9", "5IB", "99999999T"])
def test_bad_cache_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size such as 64G"):
        parse_bytes(text)


def test_the_cache_size_comes_from_every_layer(tmp_path: Path) -> None:
    base = {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"}
    assert load_config(None, {**base, "cache_memory": ByteSize("2G")}, environ={}).cache_memory == 2 * 2**30
    environ = {"DATAFERRY_CACHE_MEMORY": "3M"}
    assert load_config(None, base, environ=environ).cache_memory == 3 * 2**20
    assert _config(tmp_path, "cache_memory = 4096\n").cache_memory == 4096
    assert _config(tmp_path, 'cache_memory = "1K"\n').cache_memory == 1024
    with pytest.raises(ConfigError, match="DATAFERRY_CACHE_MEMORY='big' is not a size such as 64G"):
        load_config(None, base, environ={"DATAFERRY_CACHE_MEMORY": "big"})
    with pytest.raises(ConfigError, match=r"'cache_memory'.*is not a size"):
        _config(tmp_path, 'cache_memory = "big"\n')
    whole = r'cache_memory.* must be a whole number of bytes or text such as "64G"'
    for wrong in ("true", "1.5"):
        with pytest.raises(ConfigError, match=whole):
            _config(tmp_path, f"cache_memory = {wrong}\n")
    with pytest.raises(ConfigError, match=r"must be between 0 and 2\*\*62 bytes"):
        _config(tmp_path, f"cache_memory = {2**63 - 1}\n")


def test_a_feeds_cache_and_determinism_are_its_own(tmp_path: Path) -> None:
    """Inheriting the first feed's cache would multiply memory; its determinism goes with its pipeline."""
    cfg = _config(
        tmp_path,
        'cache_memory = "1G"\npipeline = "mypackage.aug:evaluate"\npipeline_deterministic = true\n'
        f'[feeds.val]\ndata = "{tmp_path}"\naugment = "eval"\n'
        f'[feeds.more]\ndata = "{tmp_path}"\ncache_memory = "2M"\n',
    )
    main, val, more = cfg.feeds()
    assert (main.cache_memory, main.pipeline_deterministic) == (2**30, True)
    assert (val.cache_memory, val.pipeline_deterministic) == (0, False)
    assert more.cache_memory == 2 * 2**20


def test_determinism_is_declared_of_a_pipeline_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pipeline_deterministic describes a pipeline"):
        _config(tmp_path, "pipeline_deterministic = true\n")


def test_the_summary_names_storage_options_but_never_their_values(tmp_path: Path) -> None:
    cfg_file = tmp_path / "svc.toml"
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\n'
        f'[storage]\nsecret_access_key = "s3cr3t-file"\n[feeds.val]\ndata = "{tmp_path}"\n'
    )
    cfg = load_config(cfg_file, {}, environ={}, storage_flags=["session_token=s3cr3t-flag", "region=x"])
    assert dict(cfg.storage_options) == {
        "secret_access_key": "s3cr3t-file",
        "session_token": "s3cr3t-flag",
        "region": "x",
    }
    assert all(f.storage == cfg.storage() for f in cfg.feeds()), "every feed reaches the store the same way"
    text = cfg.summary()
    assert "s3cr3t" not in text and "secret_access_key=*** session_token=***" in text
    assert "s3cr3t" not in repr(cfg.storage())


# --- the CPU budget ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400", "1e308", "65537", "-0.5"])
def test_a_cpu_budget_no_host_has_is_refused_naming_the_layer_that_set_it(tmp_path: Path, text: str) -> None:
    """inf (or a value so large that counting workers with it overflows) crashed the start with a
    traceback, exit 1; it is a bad value like any other, whichever layer gave it."""
    cfg_file = tmp_path / "svc.toml"
    # repr() of a float is TOML's spelling of it too: inf, nan, 1e+308.
    cfg_file.write_text(
        f'data = "{tmp_path}"\nendpoint = "ipc:///tmp/feed.sock"\ncpu_budget = {float(text)!r}\n'
    )
    refused = r"cpu_budget must be between 0 \(the host's limits\) and 65536 \(set by "
    with pytest.raises(ConfigError, match=refused + r"--cpu-budget\)"):
        load_config(None, {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock", "cpu_budget": float(text)})
    with pytest.raises(ConfigError, match=refused + r"DATAFERRY_CPU_BUDGET\)"):
        load_config(None, {}, environ={**base_env(tmp_path), "DATAFERRY_CPU_BUDGET": text})
    with pytest.raises(ConfigError, match=refused + r".*svc.toml\)"):
        load_config(cfg_file, {}, environ={})


@pytest.mark.parametrize(("text", "cores"), [("0", None), ("0.5", 0.5), ("65536", 65536.0)])
def test_a_cpu_budget_of_zero_means_the_hosts_limits_and_a_fraction_of_a_core_is_one(
    tmp_path: Path, text: str, cores: float | None
) -> None:
    cfg = load_config(None, {}, environ={**base_env(tmp_path), "DATAFERRY_CPU_BUDGET": text})
    assert cfg.budget.cores == cores if cores is not None else "--cpu-budget" not in cfg.budget.source
    assert 1 <= cfg.first_workers <= cfg.worker_processes <= 256


def test_the_default_filter_without_its_resampler_or_torch_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service host installed without torch where no compiler built the C resampler: before, its
    workers failed to start one after another (no module named torch) until the service gave up."""
    monkeypatch.setattr(decoders, "installed", lambda module: False)
    base = {"data": tmp_path, "endpoint": "ipc:///tmp/feed.sock"}
    with pytest.raises(ConfigError, match=r"C resampler.*or torch.*--interpolation bilinear"):
        load_config(None, base)
    assert load_config(None, {**base, "interpolation": "bilinear"}).interpolation == "bilinear"
    pipeline = tmp_path / "aug.py"
    pipeline.write_text("def f(sample, rng):\n    return {}\n")
    assert load_config(None, {**base, "pipeline": f"{pipeline}:f"}).pipeline, "a pipeline resizes its own way"


# --- named sources (--source NAME=DATA, NOTE [ Sources of a feed ]) ------------------------------


def test_sources_come_from_flags_or_a_table_and_are_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    base = {"endpoint": "ipc:///tmp/feed.sock"}
    by_flags = load_config(None, base, source_flags=["first=a", "second=s3://bucket/shards/", "third=b"])
    assert by_flags.data == "" and by_flags.sources == (
        ("first", str(tmp_path / "a")),
        ("second", "s3://bucket/shards/"),
        ("third", str(tmp_path / "b")),
    ), "in the order given; a store's URL as it is"
    cfg_file = tmp_path / "feed.toml"
    cfg_file.write_text(
        'endpoint = "ipc:///tmp/feed.sock"\n[sources]\nz = "a"\ny = "b"\n'
        '[feeds.val]\naugment = "eval"\n[feeds.val.sources]\nonly = "b"\n'
    )
    main, val = load_config(cfg_file, {}).feeds()
    assert [n for n, _ in main.sources] == ["z", "y"] and val.sources == (("only", str(tmp_path / "b")),)
    assert val.data == "", "a table with its own sources does not take the top level's data"
    flags_win = load_config(cfg_file, {}, source_flags=["x=a"])
    assert flags_win.sources == (("x", str(tmp_path / "a")),), "--source flags replace the file's table"


@pytest.mark.parametrize(
    ("data", "sources", "message"),
    [
        (True, ["a=a"], "give data or sources"),
        (False, ["a=a", "a=b"], "source names must be unique: a given twice"),
        (False, ["a b=a"], "source name 'a b' must be 1 to 64 letters"),
        (False, ["nodata"], "--source needs NAME=DATA, not 'nodata'"),
        (False, ["a="], "--source needs NAME=DATA"),
        (False, ["a=a", "gone=missing"], "source gone: missing does not exist"),
        (False, [], "data is required"),
    ],
)
def test_bad_sources_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bool, sources: list[str], message: str
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    overrides: dict[str, object] = {"endpoint": "ipc:///tmp/feed.sock", "data": "a" if data else None}
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, source_flags=sources)
