"""``python -m benchmarks.compare [A] [B]``: a change's cost, revision against revision, in one run.

    python -m benchmarks.compare                     # the merge base against the work tree
    python -m benchmarks.compare 1579eba HEAD        # two commits
    python -m benchmarks.compare HEAD HEAD --quick   # the noise floor, in a few minutes
    python -m benchmarks.compare --scenarios cold,pipeline --rounds 5 --json

Each revision is built in an environment of its own (``benchmarks/compare/revisions.py``); every
scenario (``benchmarks/compare/probe.py``) runs A then B, then B then A, round after round, on the
same generated photos; the table gives per scenario the median ratio of B to A with its spread
across rounds, and the run exits 1 when a scenario slid beyond that noise (NOTE [ A slide beyond the
noise ] in ``benchmarks/compare/verdict.py``), 2 when a revision cannot be built or a flag is bad.
Progress goes to standard error; the table (or, with ``--json``, the rows as JSON) to standard
output; ``--out`` gets ``compare.json`` with every round's figures and ``compare.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.probe import SCENARIOS
from benchmarks.compare.revisions import REPO, WORKTREE, Revision, RevisionError, build, default_base
from benchmarks.compare.verdict import Outcome, judge, table

PROBE = Path(__file__).with_name("probe.py")
PIPELINE = REPO / "examples" / "pipelines" / "albumentations_aug.py"
PROBE_TIMEOUT = 900.0
"""Seconds one scenario of one revision may take before it counts as failed."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "a", nargs="?", default="", help="the base revision (default: the merge base with main)"
    )
    parser.add_argument("b", nargs="?", default=WORKTREE, help=f"the revision measured (default: {WORKTREE})")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS)
    )
    parser.add_argument("--rounds", type=int, default=0, help="A-B pairs per scenario (default 3; --quick 2)")
    parser.add_argument("--images", type=int, default=0, help="generated photos (default 512; --quick 256)")
    parser.add_argument("--workers", type=int, default=2, help="decode processes for both contenders")
    parser.add_argument(
        "--quick", action="store_true", help="small data, few rounds: checks the path, not for quoting"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="where compare.json and the plot go"
    )
    parser.add_argument(
        "--cache", type=Path, default=Path(".dataferry-bench"), help="built revisions and photos"
    )
    args = parser.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if args.rounds < 0 or args.images < 0 or args.workers < 1:
        parser.error("--rounds and --images must be positive, --workers at least 1")
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.images = args.images or (256 if args.quick else 512)
    args.a = args.a or default_base()
    args.cache, args.out = args.cache.resolve(), args.out.resolve()  # probes run from another folder
    return args


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def photos(args: argparse.Namespace) -> Path:
    """The photos every probe reads: made once by the work tree's generator, kept in the cache."""
    from benchmarks.config import BenchConfig
    from benchmarks.datasets import prepare_data

    cfg = BenchConfig(images=args.images, cache=args.cache / "data")
    return Path(prepare_data(cfg).root)


def run_probe(
    revision: Revision, scenario: str, data: Path, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One scenario under one revision, in a fresh process of its environment."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "probe.py"
    shutil.copyfile(PROBE, script)  # run from outside the tree: only the revision's code is on the path
    command = [str(revision.python), str(script), scenario, "--data", str(data), "--work", str(work)]
    command += ["--pipeline", f"{PIPELINE}:train", "--workers", str(args.workers)]
    command += ["--epochs", "2" if args.quick else "3", *(["--quick"] if args.quick else [])]
    try:
        done = subprocess.run(
            command,
            check=False,
            cwd=revision.src,
            env=revision.env(),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return {"scenario": scenario, "error": f"timed out after {PROBE_TIMEOUT:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"scenario": scenario, "error": f"exit {done.returncode}: {done.stderr.strip()[-500:]}"}
    return dict(json.loads(lines[-1]))


def compare(
    args: argparse.Namespace, a: Revision, b: Revision, data: Path
) -> tuple[list[Outcome], dict[str, Any]]:
    outcomes, record = [], {}
    work = args.cache / "compare-runs" / time.strftime("%Y%m%d-%H%M%S")
    for scenario in args.scenarios.split(","):
        pairs = []
        for round_ in range(args.rounds):
            order = (a, b) if round_ % 2 == 0 else (b, a)
            results = {}
            for revision in order:
                say(f"[{scenario}] round {round_ + 1}/{args.rounds}: {revision.label}")
                results[revision.name, revision is a] = run_probe(
                    revision,
                    scenario,
                    data,
                    work / scenario / f"{round_}-{'a' if revision is a else 'b'}",
                    args,
                )
            pairs.append((results[a.name, True], results[b.name, False]))
        outcome = judge(scenario, pairs)
        say(f"[{scenario}] B vs A {outcome.ratio:.3f} ± {outcome.spread:.3f}: {outcome.verdict}")
        outcomes.append(outcome)
        record[scenario] = {**outcome.row(), "per_round": [{"a": pa, "b": pb} for pa, pb in pairs]}
    return outcomes, record


def plot(outcomes: list[Outcome], path: Path, a: str, b: str) -> None:
    """One bar a scenario: B against A with its spread, the tolerance shaded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("no plot: matplotlib is not installed (the bench extra)")
        return
    shown = [o for o in outcomes if not o.error]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * max(1, len(shown))))
    names = [o.scenario for o in shown]
    colours = ["tab:red" if o.slid else "tab:blue" for o in shown]
    ax.barh(names, [o.ratio - 1 for o in shown], left=1, xerr=[o.spread for o in shown], color=colours)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.axvspan(0.95, 1.05, color="grey", alpha=0.15)
    ax.set_xlabel("B vs A (above 1: B better)")
    ax.set_title(f"A = {a}\nB = {b}", fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    log: list[str] = []
    try:
        a = build(args.a, args.cache / "revisions", log)
        b = build(args.b, args.cache / "revisions", log)
    except RevisionError as exc:
        say(f"compare: {exc}")
        return 2
    for line in log:
        say(line)
    data = photos(args)
    say(f"A = {a.label}, B = {b.label}; {args.rounds} rounds of {args.scenarios} on {args.images} photos")
    outcomes, record = compare(args, a, b, data)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(
        json.dumps({"a": a.label, "b": b.label, "scenarios": record}, indent=2)
    )
    plot(outcomes, args.out / "compare.png", a.label, b.label)
    print(json.dumps([o.row() for o in outcomes]) if args.json else table(outcomes, a.label, b.label))
    return 1 if any(o.slid for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
