"""(h)'s user pipeline: which one, whether this interpreter can run it, and whether the service and a
DataLoader running it agree sample for sample.

The pipeline is the torchvision.transforms.v2 example (``examples/pipelines/torchvision_v2.py``).
torchvision is an optional extra, not a dependency: without an importable torchvision (h) is skipped
with the reason printed and reported, and the rest of the run goes on.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from benchmarks.datasets import PipelineSamples
from benchmarks.results import SERVICE, Measurement
from gpu_worker import ServiceLoader

H_PIPELINE = "examples/pipelines/torchvision_v2.py:train"
"""(h)'s pipeline, relative to the repository (as reports show it)."""
IMPORT_TIMEOUT = 120.0
"""Seconds ``import torchvision`` may take in a child (torch and torchvision, on two busy cores)."""
_REPO = Path(__file__).resolve().parent.parent


def pipeline_spec(relative: str = H_PIPELINE) -> str:
    """``relative`` with its file made absolute: the service resolves it from its own directory."""
    file, _, func = relative.rpartition(":")
    return f"{_REPO / file}:{func}"


def torchvision_problem(timeout: float = IMPORT_TIMEOUT) -> str | None:
    """Why (h) cannot run with this interpreter, or None.

    The import is tried in a child: a torchvision built for another torch fails at import ("operator
    torchvision::nms does not exist"), and this process should not carry half of it.
    """
    if importlib.util.find_spec("torchvision") is None:
        return (
            f"torchvision is not installed for this Python ({sys.version.split()[0]}, torch "
            f"{_version('torch')}); run (h) with an environment that has it (benchmarks/README.md)"
        )
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torchvision.transforms.v2"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"import torchvision took over {timeout:.0f} s"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"exit code {out.returncode}"]
        versions = f"torchvision {_version('torchvision')} beside torch {_version('torch')}"
        return f"{versions} cannot be imported: {lines[-1]}"
    return None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def same_fields(got: Mapping[str, torch.Tensor], expected: Mapping[str, object]) -> bool:
    """Whether one sample's fields are the same names, dtypes, shapes and bits."""
    if list(got) != list(expected):
        return False
    for name, tensor in got.items():
        other = torch.as_tensor(expected[name]).as_subclass(torch.Tensor)
        if other.dtype != tensor.dtype or other.shape != tensor.shape or not torch.equal(other, tensor):
            return False
    return True


def service_batch(endpoint: str, timeout: float) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """One batch from a trainer attached for it alone: copies of its fields, its indices, its epoch."""
    with ServiceLoader(endpoint, device="cpu", timeout=timeout, connect_timeout=timeout) as loader:
        batch = next(iter(loader))
        fields = {name: tensor.clone() for name, tensor in batch.items()}
        indices, epoch = batch.indices.tolist(), batch.epoch
        del batch  # before close: a batch must not outlive its loader
    return fields, indices, epoch


def identical_samples(
    fields: Mapping[str, torch.Tensor], indices: Sequence[int], epoch: int, dataset: PipelineSamples
) -> list[float]:
    """Per row of a service batch: 1.0 if the DataLoader's Dataset makes exactly its fields, else 0.0."""
    return [
        1.0 if same_fields({k: v[row] for k, v in fields.items()}, dataset[(epoch, i)]) else 0.0
        for row, i in enumerate(indices)
    ]


def measure_identical(endpoint: str, dataset: PipelineSamples, timeout: float) -> Measurement:
    """(h): does the DataLoader contender compute what the service delivers? Every sample of one batch.

    The Dataset runs in this process: its code is the DataLoader workers', and its function is
    loaded here exactly as there (``load_pipeline``, single-threaded).
    """
    fields, indices, epoch = service_batch(endpoint, timeout)
    same = identical_samples(fields, indices, epoch, dataset)
    notes = {"epoch": float(epoch)}
    return Measurement(
        "h", "h-equal", "samples identical to the DataLoader's", "samples", {SERVICE: same}, notes=notes
    )
