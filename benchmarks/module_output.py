"""What the module benchmarks (fleet, sizing, gpu, objectstore) share: a line printed at once, and
their results written as one JSON file."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def say(line: str) -> None:
    print(line, flush=True)


def write_results(out: str, name: str, results: Mapping[str, Any]) -> Path:
    """``results`` as ``NAME.json`` in the folder ``out`` (made if missing; "": a new temporary
    folder), said in one line; its path."""
    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"dataferry-{name}-results-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    say(f"results in {path}")
    return path
