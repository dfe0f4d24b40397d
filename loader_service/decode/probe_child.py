"""The probe's child process (``probe.probe_fields`` runs it): import the pipeline and run it on the
first readable sample, exactly as a worker would; the request as JSON on stdin, the result on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_service.dataset.sources import FeedSources
from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import StoreUnavailable
from loader_service.decode.contract import PipelineError
from loader_service.decode.pipeline import (
    OutputError,
    Pipeline,
    as_array,
    call_pipeline,
    failure,
    infer_fields,
    load_pipeline,
    user_traceback,
)
from loader_service.decode.probe import PROBE_SAMPLES
from loader_service.decode.reading import FeedReader
from loader_service.decode.sample import Sample
from protocol.layout import SlotLayout
from protocol.pixels import DecodeError


def probe(request: Mapping[str, Any]) -> dict[str, Any]:
    """Run the pipeline on the first readable sample (in this process): the JSON the child prints."""
    spec = str(request["pipeline"])
    try:
        fn = load_pipeline(spec)
    except PipelineError as exc:
        return {"error": str(exc)}
    index = FeedSources.load(Path(request["index_dir"]))
    options, cache_dir, cache_size, deadline = request.get("storage") or [[], "", 0, 10.0]
    storage = StorageConfig(tuple((str(k), str(v)) for k, v in options), cache_dir, cache_size, deadline)
    reader = FeedReader(index, int(request["max_file_bytes"]), storage)
    try:
        found = _probe_samples(spec, fn, index, reader, int(request["seed"]))
        if request.get("deterministic") and "fields" in found:
            found.update(_same_every_epoch(spec, fn, index, reader, int(request["seed"])))
        return found
    finally:
        reader.close()


def _probe_samples(
    spec: str, fn: Pipeline, index: FeedSources, reader: FeedReader, seed: int
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
    spec: str, fn: Pipeline, index: FeedSources, reader: FeedReader, seed: int
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
    """``python -m loader_service.decode.probe_child``: one request on stdin, one JSON result on stdout."""
    request = json.load(sys.stdin)
    result_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # Whatever the pipeline prints, from Python or C, goes to stderr: stdout carries only the result.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    result = probe(request)
    json.dump(result, result_out)
    result_out.close()


if __name__ == "__main__":
    main()
