"""``loader-service``: serve feeds, make CURVE keys, show status (once, or live with top), print an index,
make sample data, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loader_service.config import OPTIONS, ConfigError, Option, load_config
from loader_service.config.loading import parse_storage_flags
from loader_service.dataset.format import Columns
from loader_service.dataset.index import FORMAT_CHOICES, DatasetError, build_index
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.logs import configure_logging

log = logging.getLogger("loader_service")


_LAYERS = (
    "Every option is also a key of the --config TOML file (the flag name with underscores) and an "
    "environment variable (DATAFERRY_ and the key in capitals, e.g. DATAFERRY_BATCH_SIZE=64). "
    "Precedence: defaults < config file < environment < flags."
)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the loader service in the foreground", epilog=_LAYERS)
    p.add_argument("--config", type=Path, help="TOML file; keys are the flag names with underscores")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="index every feed, print the decoded size of its data and what --cache-memory would hold "
        "all of it, and exit without serving",
    )
    for opt in OPTIONS.values():
        p.add_argument(opt.flag, **_flag_spec(opt))
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an object store setting the environment does not give (endpoint=..., region=...), given "
        "to obstore; repeatable, and a [storage] table in the config file. Values are never logged",
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=DATA",
        help="a named source of the feed, DATA anything --data takes (its own format, index and saved "
        "index); repeatable, in the order the feed numbers their samples, and a [sources] table of "
        "NAME = DATA in the config file. Instead of --data; an epoch is every sample of every "
        "source once, shuffled together",
    )
    p.set_defaults(func=_cmd_serve)


def _flag_spec(opt: Option) -> dict[str, Any]:
    """argparse keywords for one option; every default is None, so load_config can tell 'not given'."""
    spec: dict[str, Any] = {"help": _flag_help(opt)}
    if opt.type is bool:
        spec["action"] = argparse.BooleanOptionalAction  # --no-strict undoes `strict = true` in a file
    else:
        spec["type"] = opt.type
    if opt.choices:
        spec["choices"] = opt.choices
    return spec


def _flag_help(opt: Option) -> str:
    if opt.required:
        return f"{opt.help} (required)"
    if opt.type is bool or opt.default == "":
        return opt.help
    return f"{opt.help} (default {opt.default})"


def _cmd_serve(args: argparse.Namespace) -> int:
    from loader_service.decode.contract import PipelineError
    from loader_service.shm import SharedMemoryError
    from loader_service.supervisor.edges.metrics import MetricsUnavailable
    from loader_service.supervisor.service import LoaderService  # keeps `index` and `--help` fast

    try:
        config = load_config(
            args.config,
            {name: getattr(args, name) for name in OPTIONS},
            storage_flags=args.storage_option,
            source_flags=args.source,
        )
    except ConfigError as exc:
        configure_logging("INFO", "service")
        log.error("configuration error: %s", exc)
        return 2
    configure_logging(config.log_level, "service")
    try:
        if args.dry_run:
            from loader_service.tools.cache_size import dry_run

            return dry_run(config)
        return LoaderService(config).run()
    except MetricsUnavailable as exc:
        log.error("configuration error: %s", exc)
        return 2
    except (DatasetError, PipelineError, ConfigError, SharedMemoryError) as exc:
        # The operator's data or code, not a crash of ours: what is wrong, already in its own words.
        log.error("cannot start: %s", exc)
        return 2
    except Exception as exc:
        # The traceback at every level: a crash that happens once in production must be diagnosable.
        log.exception("fatal: %s", exc)
        return 1


def _add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="make a CURVE key pair (NAME.key public, NAME.key_secret private)")
    p.add_argument("--out", type=Path, required=True, help="folder to write the two files into")
    p.add_argument("--name", help="file name without extension (default: this host's name)")
    p.set_defaults(func=_cmd_keys)


def _cmd_keys(args: argparse.Namespace) -> int:
    from loader_service.tools.keys import KeysError, default_name, make_keys

    try:
        pair = make_keys(args.out, args.name or default_name())
    except (KeysError, OSError) as exc:
        print(f"loader-service keys: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {pair.public} (copy it to the peers that must trust this one)")
    print(f"secret key: {pair.secret} (mode 0600; keep it on this host)")
    return 0


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a running service: feeds, slots, workers, trainers, bad files")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    p.add_argument("--server-key", help="the service's CURVE .key file (or $DATAFERRY_SERVER_KEY)")
    p.add_argument(
        "--client-key", help="a CURVE .key_secret the service authorises (or $DATAFERRY_CLIENT_KEY)"
    )
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from loader_service.tools.status_view import main_status

    return main_status(args.endpoint, args.json, args.timeout, args.server_key, args.client_key)


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top",
        help="a live view of a running service, a frame a second: each trainer's wait share and verdict, "
        "rates, workers, sample cache, slots; q or Ctrl-C quits",
    )
    p.add_argument("--endpoint", required=True)
    p.add_argument("--once", action="store_true", help="print one frame (two snapshots 1 s apart) and exit")
    p.add_argument("--json", action="store_true", help="with --once: print the frame as JSON")
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for each answer before saying it is lost (default 5)",
    )
    p.add_argument("--server-key", help="the service's CURVE .key file (or $DATAFERRY_SERVER_KEY)")
    p.add_argument(
        "--client-key", help="a CURVE .key_secret the service authorises (or $DATAFERRY_CLIENT_KEY)"
    )
    p.set_defaults(func=_cmd_top)


def _cmd_top(args: argparse.Namespace) -> int:
    from loader_service.tools.top_live import main_top

    if args.json and not args.once:
        print("loader-service top: --json prints one frame: give --once too", file=sys.stderr)
        return 2
    return main_top(args.endpoint, args.once, args.json, args.timeout, args.server_key, args.client_key)


def _add_index(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "index",
        help="print the dataset index: INDEX<TAB>LABEL<TAB>PATH per sample (PATH is shard.tar:key for tar)",
    )
    p.add_argument(
        "--data",
        required=True,
        help="an ImageFolder, a .csv or .jsonl list, a folder of .tar shards or .parquet files, one such "
        "file, or a brace pattern such as 'shards/train-{000000..000127}.tar'; in an object store too",
    )
    p.add_argument(
        "--format", choices=FORMAT_CHOICES, default="auto", help="the data's format (default auto)"
    )
    p.add_argument("--image-column", default="", help="Parquet, save_to_disk, TFRecord: as for serve")
    p.add_argument("--label-column", default="label", help="Parquet, save_to_disk, TFRecord: as for serve")
    p.add_argument("--label-offset", type=int, default=0, help="TFRecord: as for serve")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", help="as for serve")
    p.set_defaults(func=_cmd_index)


def _cmd_index(args: argparse.Namespace) -> int:
    configure_logging("WARNING", "index")  # damaged shards are logged as they are scanned
    try:
        storage = StorageConfig(tuple(parse_storage_flags(args.storage_option).items()))
        index = build_index(
            args.data,
            args.format,
            lambda n: print(f"indexing: {n} samples", file=sys.stderr),
            storage,
            Columns(args.image_column, args.label_column, args.label_offset),
        )
    except (DatasetError, ConfigError) as exc:
        print(f"loader-service index: {exc}", file=sys.stderr)
        return 2
    try:
        for i in range(len(index)):
            sys.stdout.write(f"{i}\t{int(index.labels[i])}\t{index.relpath(i)}\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `loader-service index | head` is normal use
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _add_sample_data(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-sample-data", help="write a synthetic photo-like JPEG ImageFolder dataset")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sample_data)


def _cmd_sample_data(args: argparse.Namespace) -> int:
    from loader_service.tools.sample_data import make_sample_dataset, progress_printer

    try:
        summary = make_sample_dataset(
            args.out,
            classes=args.classes,
            per_class=args.per_class,
            seed=args.seed,
            progress=progress_printer("sample images"),
        )
    except ValueError as exc:
        print(f"loader-service make-sample-data: {exc}", file=sys.stderr)
        return 2
    print(
        f"{summary.images} images in {summary.classes} classes at {summary.root} "
        f"({summary.total_bytes / 2**20:.1f} MiB, mean {summary.mean_width:.0f}x{summary.mean_height:.0f})"
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="make sample data, start the service, train the demo CNN for an epoch")
    p.add_argument("--dir", type=Path, default=Path(".dataferry-demo"), help="where the sample data goes")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=160)
    p.add_argument("--epochs", type=int, default=1)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from loader_service.tools.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loader-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_keys, _add_status, _add_top, _add_index, _add_sample_data, _add_demo):
        add(sub)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """One command's parser (``serve``...): what its ``--help`` lists, for the docs and their tests."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
