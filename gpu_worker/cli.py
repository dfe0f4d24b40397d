"""``gpu-worker``: run a training step over a loader service feed."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from gpu_worker.client import ServiceLoader
from gpu_worker.connection import ServiceError
from gpu_worker.loader_config import ENDPOINTS_ENV, TRANSPORT_CHOICES
from gpu_worker.metrics import MetricsUnavailable
from gpu_worker.runner import RunConfig, run
from protocol.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train over the feed, reporting images/s and data stall per epoch")
    _connection_arguments(p)
    p.add_argument(
        "--step",
        default=RunConfig.step,
        help="MODULE:FUNCTION called as step(*fields): step(images, labels)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--metrics-port", type=int, default=0, help="serve the batch-wait histogram (Prometheus)")
    f = sub.add_parser("fields", help="print the feed's fields (NAME, DTYPE, SHAPE of a sample)")
    _connection_arguments(f)
    return parser


def _connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help=f"a service's endpoint (ipc:// or tcp://); more than once for a fleet (or ${ENDPOINTS_ENV})",
    )
    p.add_argument(
        "--resolve-interval",
        type=float,
        default=5.0,
        help="seconds between lookups of an endpoint that names a host: every address it resolves to "
        "is a service of the fleet, followed as it changes (0: once; default 5)",
    )
    p.add_argument("--feed", default="", help="feed name (default: the service's feed)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a batch or the service")
    p.add_argument("--transport", default="auto", choices=TRANSPORT_CHOICES, help="how batches arrive (auto)")
    p.add_argument("--server-key", default="", help=f"the service's CURVE .key file (or ${SERVER_KEY_ENV})")
    p.add_argument(
        "--client-key", default="", help=f"this trainer's CURVE .key_secret file (or ${CLIENT_KEY_ENV})"
    )


def print_fields(args: argparse.Namespace) -> None:
    """One line per field, tab-separated: ``image  uint8  [3, 224, 224]``, in the order a batch unpacks."""
    with ServiceLoader(
        args.endpoint or None,
        feed=args.feed,
        timeout=args.timeout,
        connect_timeout=args.timeout,
        transport=args.transport,
        server_key=args.server_key or None,
        client_key=args.client_key or None,
        resolve_interval=args.resolve_interval,
    ) as loader:
        for spec in loader.layout.fields:
            print(f"{spec.name}\t{spec.dtype}\t{list(spec.shape)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s gpu-worker[%(process)d] %(message)s"
    )
    if args.command == "fields":
        return _guarded(lambda: print_fields(args))
    if args.epochs < 1:
        print("gpu-worker: --epochs must be at least 1", file=sys.stderr)
        return 2
    cfg = RunConfig(
        endpoints=tuple(args.endpoint),
        step=args.step,
        device=args.device,
        epochs=args.epochs,
        feed=args.feed,
        timeout=args.timeout,
        metrics_port=args.metrics_port,
        transport=args.transport,
        server_key=args.server_key,
        client_key=args.client_key,
        resolve_interval=args.resolve_interval,
    )
    return _guarded(lambda: run(cfg))


def _guarded(command: Callable[[], object]) -> int:
    """Run ``command``; its expected failures are one line on stderr and exit status 1."""
    try:
        command()
    except (ServiceError, ValueError, ImportError, MetricsUnavailable) as exc:
        print(f"gpu-worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
