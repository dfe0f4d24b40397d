"""Learn a pipeline's batch fields at start: run it on sample 0 in a child process.

The service must know the fields (names, shapes, dtypes) before it can size the slots, and the only
source is the pipeline itself. Importing user code into the service process would leave its threads,
imports and global state there for the service's whole life, and a pipeline that hangs or crashes
the interpreter would take the start with it; so ``probe_fields`` runs
``loader_service.decode.probe_child`` in a child process (``CHILD_BOOT``) with a timeout: the request
as JSON on stdin, the result as JSON on stdout (the pipeline's own prints are sent to stderr)::

    stdin:  {"pipeline": "aug.py:train", "index_dir": "...", "seed": 0, "max_file_bytes": 268435456}
    stdout: {"fields": [["image", "float16", [3, 224, 224]], ["label", "int64", []]], "warnings": [...]}
        or  {"error": "pipeline aug.py:train failed on sample 0 (cat/1.jpg):\\nTraceback ..."}

The child runs the pipeline exactly as a worker would (``single_threaded`` before the import, the
seeding of NOTE [ Pipeline determinism ], epoch 0), twice, and warns if the two outputs differ. If
sample 0's file is bad (a ``DecodeError`` reading it, not a pipeline failure) it moves on to the next
sample, up to ``PROBE_SAMPLES``: one damaged file must not stop a start.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loader_service.dataset.index import LOCAL
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.decode.contract import PipelineError
from protocol.layout import FieldSpec

__all__ = ["PROBE_SAMPLES", "PipelineError", "probe_fields"]

log = logging.getLogger(__name__)
PROBE_SAMPLES = 16
"""Samples tried, from 0 on, while each is a bad file; a pipeline error on any of them is final."""
CHILD = "loader_service.decode.probe_child"
"""The module the probe runs (``CHILD_BOOT``): it imports the pipeline, this one never does."""
CHILD_BOOT = (
    "import sys\n"
    "if not getattr(sys.flags, 'safe_path', False):\n"
    "    del sys.path[0]  # the working folder, which -c puts first\n"
    f"from {CHILD} import main\n"
    "main()\n"
)
"""``python -m CHILD`` without the working folder on its path: the service's may be a folder other
users write in (a trainer's private service starts in the trainer's), and a package planted there
must not run (NOTE [ Nothing from the working folder ] in loader_service/working_folder.py)."""
MAX_STDERR = 4000
"""Characters of the child's stderr quoted when it dies without a result."""


def probe_fields(
    pipeline: str,
    index_dir: Path,
    seed: int,
    max_file_bytes: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    deterministic: bool = False,
    storage: StorageConfig = LOCAL,
) -> tuple[FieldSpec, ...]:
    """The fields ``pipeline`` returns for sample 0 of epoch 0, in its dict's order.

    PipelineError, with the user's traceback where there is one, if the pipeline cannot be imported,
    raises or returns something that is not a batch (not a dict, an unsupported dtype, a GPU tensor),
    or takes over ``timeout`` seconds (the import included). ``env``: the child's environment
    (default: this process's; the decode workers get the same, so the probe sees what they will).
    ``deterministic``: the pipeline is declared to give every epoch the same output, which a cache of
    finished samples relies on; a PipelineError if sample 0's output differs between epochs 0 and 1.
    """
    request = {
        "pipeline": pipeline,
        "index_dir": str(index_dir),
        "seed": seed,
        "max_file_bytes": max_file_bytes,
        "deterministic": deterministic,
        "storage": [
            list(map(list, storage.options)),
            storage.cache_dir,
            storage.cache_size,
            storage.read_deadline,
        ],
    }
    stdout, stderr, code = _run_child(json.dumps(request), pipeline, timeout, env)
    result = _parse(stdout)
    if result is None:
        raise PipelineError(
            f"pipeline {pipeline}: the probe process exited with {_exit_text(code)} before it reported "
            f"on sample 0; its output:\n{stderr[-MAX_STDERR:].rstrip()}"
        )
    if "error" in result:
        raise PipelineError(str(result["error"]))
    for warning in result.get("warnings", ()):
        log.warning("%s", warning)
    try:
        return tuple(FieldSpec(str(n), str(d), tuple(s)) for n, d, s in result["fields"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PipelineError(f"pipeline {pipeline}: the probe reported no usable fields: {exc}") from None


def _run_child(
    request: str, pipeline: str, timeout: float, env: Mapping[str, str] | None
) -> tuple[str, str, int]:
    # A session of its own: on a timeout the whole tree goes, processes the pipeline started included,
    # so none keeps the pipes open and communicate() returns.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_BOOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # What a pipeline or a library it loads prints need not be UTF-8: it must not fail the start.
        encoding="utf-8",
        errors="replace",
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise PipelineError(
            f"pipeline {pipeline}: no result for sample 0 within {timeout:g} s (import included); "
            "a pipeline that hangs cannot fill batches"
        ) from None
    except BaseException:
        _kill_group(child)
        raise
    return stdout, stderr, child.returncode


def _kill_group(child: subprocess.Popen[str]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        # A process that left the group (setsid) may still hold the pipes: do not wait on it.
        child.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()


def _parse(stdout: str) -> dict[str, Any] | None:
    try:
        result = json.loads(stdout)
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
