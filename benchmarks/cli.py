"""``python -m benchmarks``: parse flags, run, print the table, write JSON, plot and markdown.

Exit codes: 0 the benchmark ran (whether or not the service met its targets: they are reported, not
enforced), 1 it could not run (a process failed, a timeout), 2 a bad flag, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TypeVar

from benchmarks.config import (
    SCENARIO_TITLES,
    SCENARIOS,
    BenchConfig,
    ConfigError,
    make_config,
    parse_interpolations,
    parse_scenarios,
)
from benchmarks.progress import say
from benchmarks.report import format_table, markdown, to_json
from benchmarks.results import BenchResults, evaluate_targets
from benchmarks.service_process import BenchError
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import DECODERS

T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    scenario_help = "; ".join(f"{s}: {t}" for s, t in SCENARIO_TITLES.items())
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="ImageFolder to read (default: generate the sample dataset)")
    p.add_argument(
        "--cache", type=Path, help="where generated datasets are kept (default .dataferry-bench/data)"
    )
    p.add_argument("--images", type=int, help="size of the generated dataset (default 2560; --quick 1024)")
    p.add_argument("--workers", type=int, help="CPU processes for every contender (default 2)")
    p.add_argument(
        "--decoder",
        choices=DECODERS,
        help="the service's JPEG decoding (default auto: the region decoder where it is built)",
    )
    p.add_argument(
        "--interpolations",
        type=parse_interpolations,
        help=f"comma-separated resize filters that (a) and (f) time, each in the service and in "
        f"DataLoader+OpenCV (default {','.join(INTERPOLATIONS)}); the first is also the one (b)-(e), "
        "(g) and (k) use",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds of (a), (f), (h)-(k) (default 5; --quick 3); more on a busy machine",
    )
    p.add_argument(
        "--scenarios",
        type=parse_scenarios,
        help=f"comma-separated subset of {','.join(SCENARIOS)} ({scenario_help})",
    )
    p.add_argument(
        "--quick", action="store_true", help="small dataset, few batches: a smoke test of a few minutes"
    )
    p.add_argument(
        "--json",
        type=Path,
        dest="json_path",
        help="results for machines (default bench-results/results.json)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        dest="plot_path",
        help="PNG of throughput, stall and memory (default bench-results/throughput.png)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (and the matplotlib import)")
    p.add_argument(
        "--markdown", type=Path, dest="markdown_path", help="write a section for docs/benchmarks/log.md"
    )
    return p


def _check_plotting(cfg: BenchConfig) -> None:
    """Refuse before the run, not after minutes of measuring, when the PNG cannot be drawn."""
    if cfg.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("the plot needs matplotlib: pip install -e .[bench], or pass --no-plot")


def config_from(args: argparse.Namespace) -> BenchConfig:
    keys = (
        "data", "cache", "images", "workers", "decoder", "interpolations", "rounds", "scenarios",
        "json_path", "plot_path", "markdown_path",
    )  # fmt: skip
    cfg = make_config(args.quick, **{k: getattr(args, k) for k in keys})
    return replace(cfg, plot_path=None) if args.no_plot else cfg


def command_line(cfg: BenchConfig) -> str:
    """The flags this run was given, as a reader would retype them; ``--data`` without its path."""
    preset = make_config(cfg.quick)
    parts = ["python -m benchmarks"]
    if cfg.quick:
        parts.append("--quick")
    if cfg.data is not None:
        parts.append("--data DIR")
    elif cfg.images != preset.images:
        parts.append(f"--images {cfg.images}")
    if cfg.workers != preset.workers:
        parts.append(f"--workers {cfg.workers}")
    if cfg.decoder != preset.decoder:
        parts.append(f"--decoder {cfg.decoder}")
    if cfg.interpolations != preset.interpolations:
        parts.append(f"--interpolations {','.join(cfg.interpolations)}")
    if cfg.rounds != preset.rounds:
        parts.append(f"--rounds {cfg.rounds}")
    if cfg.scenarios != preset.scenarios:
        parts.append(f"--scenarios {','.join(cfg.scenarios)}")
    return " ".join(parts)


def write_outputs(cfg: BenchConfig, results: BenchResults) -> None:
    """Table to stdout; JSON, plot and markdown to their files."""
    checks = evaluate_targets(results)
    print(format_table(results, checks), flush=True)
    cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
    cfg.json_path.write_text(json.dumps(to_json(results, checks), indent=2, allow_nan=False) + "\n")
    say(f"wrote {cfg.json_path}")
    if cfg.plot_path is not None:
        from benchmarks.plot import write_plot

        write_plot(results, cfg.plot_path)
        say(f"wrote {cfg.plot_path}")
    if cfg.markdown_path is not None:
        cfg.markdown_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.markdown_path.write_text(markdown(results, checks, command_line(cfg)))
        say(f"wrote {cfg.markdown_path}")


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM becomes SystemExit, so every ``finally`` runs and no service is left behind."""
    raise SystemExit(128 + signum)


def run_benchmark(prog: str, job: Callable[[], T], finish: Callable[[T], None]) -> int:
    """Run ``job`` with SIGTERM turned into SystemExit, then hand its results to ``finish``. The exit
    code: 0; 1 when a process failed or timed out (``BenchError``); 2 for a bad setting; 130 when
    interrupted. Each failure is one line on stderr, prefixed with ``prog``."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        results = job()
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; services and workers stopped", file=sys.stderr)
        return 130
    finish(results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from(args)
        _check_plotting(cfg)
    except ConfigError as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    from benchmarks.run import run  # torch, cv2 and the service client load only for a real run

    return run_benchmark(
        "python -m benchmarks", lambda: run(cfg), lambda results: write_outputs(cfg, results)
    )
