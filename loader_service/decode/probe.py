"""Learn a pipeline's batch fields at start: run it on sample 0 in a child process.

The service must know the fields (names, shapes, dtypes) before it can size the slots, and the only
source is the pipeline itself. Importing user code into the service process would leave its threads,
imports and global state there for the service's whole life, and a pipeline that hangs or crashes
the interpreter would take the start with it; so ``probe_fields`` runs
``python -m loader_service.decode.probe`` with a timeout: the request as JSON on stdin, the result as
JSON on stdout (the pipeline's own prints are sent to stderr)::

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

import numpy as np
import numpy.typing as npt

from loader_service.dataset.index import LOCAL, DatasetIndex
from loader_service.dataset.storage.objectstore import StorageConfig, StoreUnavailable
from loader_service.dataset.tables import DecodeError
from loader_service.decode.pipeline import (
    OutputError,
    Pipeline,
    PipelineError,
    as_array,
    call_pipeline,
    failure,
    infer_fields,
    load_pipeline,
    user_traceback,
)
from loader_service.decode.reading import SampleReader
from loader_service.decode.sample import Sample
from protocol.layout import FieldSpec, SlotLayout

__all__ = ["PROBE_SAMPLES", "PipelineError", "probe_fields"]

log = logging.getLogger(__name__)
PROBE_SAMPLES = 16
"""Samples tried, from 0 on, while each is a bad file; a pipeline error on any of them is final."""
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
        [sys.executable, "-m", __name__],
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


# --- the child ------------------------------------------------------------------------------------


def probe(request: Mapping[str, Any]) -> dict[str, Any]:
    """Run the pipeline on the first readable sample (in this process): the JSON the child prints."""
    spec = str(request["pipeline"])
    try:
        fn = load_pipeline(spec)
    except PipelineError as exc:
        return {"error": str(exc)}
    index = DatasetIndex.load(Path(request["index_dir"]))
    options, cache_dir, cache_size, deadline = request.get("storage") or [[], "", 0, 10.0]
    storage = StorageConfig(tuple((str(k), str(v)) for k, v in options), cache_dir, cache_size, deadline)
    reader = SampleReader(index, int(request["max_file_bytes"]), storage)
    try:
        found = _probe_samples(spec, fn, index, reader, int(request["seed"]))
        if request.get("deterministic") and "fields" in found:
            found.update(_same_every_epoch(spec, fn, index, reader, int(request["seed"])))
        return found
    finally:
        reader.close()


def _probe_samples(
    spec: str, fn: Pipeline, index: DatasetIndex, reader: SampleReader, seed: int
) -> dict[str, Any]:
    if len(index) == 0:
        return {"error": f"pipeline {spec}: the dataset has no samples to run it on"}
    skipped: list[str] = []
    for i in range(min(len(index), PROBE_SAMPLES)):
        where = f"sample {i} ({index.relpath(i)})"
        try:
            result = call_pipeline(fn, Sample(reader, index, i, 0), seed)
        except DecodeError as exc:
            skipped.append(f"pipeline {spec}: {where} is a bad file ({exc}); the probe tried the next")
            continue
        except StoreUnavailable as exc:  # not the pipeline's failure
            return {"error": f"pipeline {spec}: the data's store did not answer reading {where}: {exc}"}
        except Exception as exc:
            return {"error": f"pipeline {spec} failed on {where}:\n{user_traceback(exc)}"}
        try:
            fields = infer_fields(result)
            SlotLayout(1, fields)  # the limits on field count and slot size
        except (OutputError, ValueError) as exc:
            return {"error": f"pipeline {spec} returned no usable batch for {where}: {exc}"}
        again = Sample(reader, index, i, 0)
        warnings = skipped + _hidden(spec, again) + _rerun(spec, fn, again, seed, _copies(result))
        return {"fields": [[f.name, f.dtype, list(f.shape)] for f in fields], "warnings": warnings}
    return {
        "error": "\n".join([f"pipeline {spec}: the first {PROBE_SAMPLES} samples are bad files", *skipped])
    }


def _same_every_epoch(
    spec: str, fn: Pipeline, index: DatasetIndex, reader: SampleReader, seed: int
) -> dict[str, Any]:
    """A pipeline declared deterministic whose first good sample differs between epochs 0 and 1:
    an error, since its cache would freeze one epoch's random augmentation for all."""
    for i in range(min(len(index), PROBE_SAMPLES)):
        try:
            first = _copies(call_pipeline(fn, Sample(reader, index, i, 0), seed))
        except DecodeError:
            continue
        try:
            second = _copies(call_pipeline(fn, Sample(reader, index, i, 1), seed))
        except Exception as exc:
            return {"error": f"pipeline {spec} failed on sample {i} of epoch 1:\n{user_traceback(exc)}"}
        differ = [name for name, array in first.items() if not _same(array, second.get(name))]
        if not differ:
            return {}
        return {
            "error": f"pipeline {spec} is declared deterministic (pipeline_deterministic), but field "
            f"{differ[0]!r} of sample {i} differs between epochs 0 and 1: its cache would keep one "
            "epoch's random augmentation for every epoch. Drop pipeline_deterministic, or make the "
            "pipeline draw no randomness"
        }
    return {}


def _copies(result: object) -> dict[str, npt.NDArray[Any]]:
    """The fields of a (valid) return value, copied: a pipeline may reuse its output buffers."""
    assert isinstance(result, Mapping)
    return {name: np.array(as_array(name, value)) for name, value in result.items()}


def _hidden(spec: str, sample: Sample) -> list[str]:
    list(sample)  # lists the metadata, which fills sample.hidden
    return [
        f"pipeline {spec}: metadata {name!r} of {sample['path']} is hidden by the sample's own {name!r}"
        for name in sample.hidden
    ]


def _rerun(
    spec: str, fn: Pipeline, sample: Sample, seed: int, first: dict[str, npt.NDArray[Any]]
) -> list[str]:
    """NOTE [ Pipeline determinism ]: a second run on the same sample must give the same output."""
    where = f"sample {sample['index']}"
    try:
        second = _copies(call_pipeline(fn, sample, seed))
    except Exception as exc:
        return [f"pipeline {spec}: a second run on {where} failed ({failure(exc)}); is it deterministic?"]
    return [
        f"pipeline {spec}: field {name!r} differs between two runs on {where} with the same seed: it "
        "draws randomness the service does not seed (use the rng argument, or the random, "
        "numpy.random or torch global generators, which the service seeds per sample)"
        for name, array in first.items()
        if not _same(array, second.get(name))
    ]


def _same(a: npt.NDArray[Any], b: npt.NDArray[Any] | None) -> bool:
    """Bit for bit, so that NaNs in the same places count as equal."""
    if b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def main() -> None:
    """``python -m loader_service.decode.probe``: one request on stdin, one JSON result on stdout."""
    request = json.load(sys.stdin)
    result_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # Whatever the pipeline prints, from Python or C, goes to stderr: stdout carries only the result.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    result = probe(request)
    json.dump(result, result_out)
    result_out.close()


if __name__ == "__main__":
    main()
