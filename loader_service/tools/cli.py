"""``loader-service``: serve a feed, print a dataset index, make sample data, run the demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from loader_service.config import AUGMENTS, ConfigError, load_config
from loader_service.dataset.index import DatasetError, build_index
from loader_service.decode.transforms import DECODERS
from loader_service.logs import configure_logging

log = logging.getLogger("loader_service")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the loader service in the foreground")
    p.add_argument("--config", type=Path, help="TOML file; keys are the flag names with underscores")
    p.add_argument("--data", type=Path, help="ImageFolder root (one folder per class)")
    p.add_argument("--endpoint", help="ipc:///path/to.sock or tcp://host:port")
    p.add_argument("--workers", type=int, help="decode worker processes (default 2)")
    p.add_argument("--batch-size", type=int, help="images per batch (default 64)")
    p.add_argument("--image-size", type=int, help="output side in pixels (default 224)")
    p.add_argument("--augment", choices=AUGMENTS, help="transform (default train)")
    p.add_argument("--seed", type=int, help="seed for permutations and augmentation (default 0)")
    p.add_argument("--slots", type=int, help="batches in the shared-memory pool (default 2*workers+8)")
    p.add_argument("--feed", help="feed name trainers may ask for (default train)")
    p.add_argument(
        "--client-timeout", type=float, help="seconds of trainer silence before its leases are reclaimed"
    )
    p.add_argument(
        "--lag-timeout", type=float, help="seconds one broadcast member may hold its group up (30)"
    )
    p.add_argument("--strict", action="store_const", const=True, help="stop at the first undecodable file")
    p.add_argument("--max-pixels", type=int, help="refuse images claiming more pixels (default 89478485)")
    p.add_argument(
        "--decoder",
        choices=DECODERS,
        help="train-transform JPEG decoding: auto (region decoder if built), opencv, jpeg-roi",
    )
    p.add_argument("--group", help="unix group whose members may attach (segments and socket 0660)")
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (needs prometheus_client)"
    )
    p.add_argument("--metrics-addr", help="address for the metrics port (default 127.0.0.1)")
    p.add_argument("--task-timeout", type=float, help="seconds a worker may spend on one batch (120)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from loader_service.supervisor.metrics import MetricsUnavailable
    from loader_service.supervisor.service import LoaderService  # keeps `index` and `--help` fast

    keys = (
        "data",
        "endpoint",
        "workers",
        "batch_size",
        "image_size",
        "augment",
        "seed",
        "slots",
        "feed",
        "client_timeout",
        "lag_timeout",
        "task_timeout",
        "strict",
        "max_pixels",
        "decoder",
        "group",
        "metrics_port",
        "metrics_addr",
        "log_level",
    )
    try:
        config = load_config(args.config, {k: getattr(args, k) for k in keys})
    except ConfigError as exc:
        configure_logging("INFO", "service")
        log.error("configuration error: %s", exc)
        return 2
    configure_logging(config.log_level, "service")
    try:
        return LoaderService(config).run()
    except MetricsUnavailable as exc:
        log.error("configuration error: %s", exc)
        return 2
    except Exception as exc:
        log.error("fatal: %s", exc, exc_info=config.log_level == "DEBUG")
        return 1


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a running service: feeds, slots, workers, trainers, bad files")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from loader_service.tools.status_view import main_status

    return main_status(args.endpoint, args.json, args.timeout)


def _add_index(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("index", help="print the dataset index: INDEX<TAB>LABEL<TAB>PATH per sample")
    p.add_argument("--data", type=Path, required=True)
    p.set_defaults(func=_cmd_index)


def _cmd_index(args: argparse.Namespace) -> int:
    try:
        index = build_index(args.data, progress=lambda n: print(f"indexing: {n} files", file=sys.stderr))
    except DatasetError as exc:
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
    for add in (_add_serve, _add_status, _add_index, _add_sample_data, _add_demo):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
