"""User pipelines: ``FUNC(sample, rng)`` run in the decode workers, its fields written into the slot.

``--pipeline FILE.py:FUNC`` or ``--pipeline package.module:FUNC`` names a function the workers call
once per sample in place of the built-in transforms. It gets a ``Sample`` (a read-only mapping whose
``image`` is decoded only when read) and a ``numpy.random.Generator`` drawn from (seed, epoch, index);
it returns a dict of named numpy arrays or CPU torch tensors. ``store_output`` checks that dict against
the feed's batch layout (learnt from sample 0 at start, ``probe.probe_fields``) and copies each field
straight into its row of the slot: no pickling, no batch-sized intermediate.

NOTE [ Pipeline determinism ]
A sample's output must not depend on which worker made it, nor on what that worker made before:
trainers in a group, a restarted worker redoing a task, and a resumed epoch all rely on it. The
``rng`` argument is ``sampler.sample_rng(seed, epoch, index)``, as for the built-in transforms. But
libraries draw from global generators too (torchvision.transforms.v2 from torch's; older
albumentations from Python's ``random`` and numpy's), and a global generator's state depends on every
sample the worker ran before. So before each call ``seed_globals`` reseeds Python's ``random``,
numpy's legacy global generator and torch's CPU generator from (seed, epoch, index) as well (through
a SeedSequence of its own, so those streams are not ``rng``'s). Anything else (time, os.urandom, a
generator the user created at import and never reseeds, such as an albumentations 2.x ``Compose``'s)
is the pipeline's own affair; ``probe_fields`` warns at start when two runs on the same sample
differ.

NOTE [ Pipeline failures are data ]
An exception in the pipeline, or a return value that does not match the layout, makes that one sample
bad, reported with a one-line reason (``pipeline: ValueError: ...``) like an undecodable file. A file
the sample cannot read (``sample["image"]`` raising ``DecodeError``) keeps its decode reason. Only a
pipeline that cannot be imported stops a worker (a boot error, so the service backs off).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import random
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import cv2
import numpy as np
import numpy.typing as npt

from loader_service.dataset.sampler import sample_rng
from loader_service.dataset.storage.storeerrors import StoreUnavailable
from loader_service.decode.contract import PIPELINE_REASON, THREAD_ENV, PipelineError, parse_spec
from loader_service.decode.sample import Sample
from protocol.layout import DTYPES, FieldSpec
from protocol.pixels import DecodeError

Pipeline = Callable[["Sample", np.random.Generator], object]
"""What ``--pipeline`` names: ``FUNC(sample, rng) -> {name: array or tensor}``."""

MAX_REASON = 200
"""Characters of a bad-sample reason: one short line, as for undecodable files."""

_HERE = Path(__file__).resolve().parent
_GLOBAL_SEEDS = 0x610B
"""Mixed into the global generators' SeedSequence, so their streams differ from ``rng``'s."""


class OutputError(Exception):
    """A pipeline's return value that does not fit: ``str()`` says how, naming the field."""


# --- loading --------------------------------------------------------------------------------------


def single_threaded() -> None:
    """One thread for OpenCV, torch and the BLAS/OpenMP pools: a worker is one core's worth of work,
    and N workers each starting a pool of N threads oversubscribe the machine.

    Called before the pipeline is imported, so code that runs at import time already sees it.
    """
    for name in THREAD_ENV:
        os.environ[name] = "1"  # read by OpenMP and BLAS libraries when they first load
    cv2.setNumThreads(1)
    if importlib.util.find_spec("torch") is None:
        return
    # NOTE [ Pipeline determinism ]: torch is imported now, not later by the pipeline, so its
    # generator exists, and is reseeded, from the very first sample.
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # settable once per process, before any inter-op work; already done


def load_pipeline(spec: str) -> Pipeline:
    """Import the function ``spec`` names, after ``single_threaded``; PipelineError with the
    traceback if it cannot be imported or is not callable.

    As ``python FILE.py`` and ``python -m`` would, the file's folder (or, for a module, the current
    directory) goes first on ``sys.path``, so the pipeline can import its neighbours.
    """
    try:
        target, func = parse_spec(spec)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    single_threaded()
    try:
        module = _import_file(Path(target)) if target.endswith(".py") else _import_module(target)
    except (Exception, SystemExit) as exc:  # a sys.exit() at import must not end the worker quietly
        raise PipelineError(f"pipeline {spec}: cannot import {target}:\n{user_traceback(exc)}") from None
    fn = getattr(module, func, None)
    if fn is None:
        raise PipelineError(f"pipeline {spec}: {target} defines no {func}")
    if not callable(fn):
        raise PipelineError(f"pipeline {spec}: {func} in {target} is a {type(fn).__name__}, not a function")
    return cast(Pipeline, fn)


def _import_file(path: Path) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    # A name of its own per file: two feeds' pipelines may both be called train.py.
    name = f"dataferry_pipeline_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    _path_first(str(path.parent))
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up here
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(name: str) -> ModuleType:
    _path_first(os.getcwd())
    return importlib.import_module(name)


def _path_first(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the user's code on: our own and importlib's frames are noise."""
    frames = traceback.extract_tb(exc.__traceback__)
    kept = [f for f in frames if not _ours(f.filename)]
    lines = traceback.format_list(kept) + traceback.format_exception_only(type(exc), exc)
    return ("Traceback (most recent call last):\n" if kept else "") + "".join(lines).rstrip()


def _ours(filename: str) -> bool:
    """A frame of this package (the probe, the sample, decoding) or of the import machinery."""
    return filename.startswith("<frozen importlib") or Path(filename).parent == _HERE


# --- running it -----------------------------------------------------------------------------------


def seed_globals(seed: int, epoch: int, index: int) -> None:
    """Reseed Python's, numpy's legacy and torch's CPU global generators for one sample
    (NOTE [ Pipeline determinism ])."""
    words = np.random.SeedSequence([seed, epoch, index, _GLOBAL_SEEDS]).generate_state(4, np.uint64)
    random.seed(int(words[0]))
    np.random.seed(words[1:3].view(np.uint32))
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator alone: torch.manual_seed would also visit every accelerator's, at ~0.3 ms.
        torch.default_generator.manual_seed(int(words[3]))


def call_pipeline(fn: Pipeline, sample: Sample, seed: int) -> object:
    """``fn(sample, rng)`` with every generator seeded from (seed, epoch, index)."""
    sample.check()
    index, epoch = sample["index"], sample["epoch"]
    seed_globals(seed, epoch, index)
    return fn(sample, sample_rng(seed, epoch, index))


def as_array(name: str, value: object) -> npt.NDArray[Any]:
    """A returned field as a numpy array (a view of a CPU tensor, no copy); OutputError if it is
    not an array, tensor or plain number, or its dtype is not one a batch can hold."""
    array = _to_numpy(name, value)
    if array.dtype.name not in DTYPES:
        raise OutputError(f"field {name!r} has dtype {array.dtype}, not one of {', '.join(DTYPES)}")
    return array


def _to_numpy(name: str, value: object) -> npt.NDArray[Any]:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    # Plain numbers: bool before int, as bool is an int. A label is most naturally sample["label"].
    for kind, dtype in ((bool, np.bool_), (int, np.int64), (float, np.float64)):
        if isinstance(value, kind):
            try:
                return np.asarray(value, dtype)
            except OverflowError:
                raise OutputError(f"field {name!r}: {value} does not fit int64") from None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor_to_numpy(name, value, torch)
    raise OutputError(f"field {name!r} is a {type(value).__name__}, not a numpy array or torch tensor")


def _tensor_to_numpy(name: str, tensor: Any, torch: Any) -> npt.NDArray[Any]:
    if tensor.device.type != "cpu":
        raise OutputError(f"field {name!r} is a tensor on {tensor.device}; return CPU tensors")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise OutputError(f"field {name!r} has dtype {tensor.dtype}, not one of {', '.join(DTYPES)}")
    try:
        # A plain Tensor first: subclasses (torchvision's tv_tensors.Image) may wrap what they return.
        return cast(npt.NDArray[Any], tensor.detach().as_subclass(torch.Tensor).numpy())
    except (RuntimeError, TypeError) as exc:  # sparse, quantized, ...
        raise OutputError(f"field {name!r}: {exc}") from None


def _arrays(result: object) -> dict[str, npt.NDArray[Any]]:
    if not isinstance(result, Mapping):
        raise OutputError(f"returned a {type(result).__name__}, not a dict of fields")
    if not all(isinstance(k, str) for k in result):
        raise OutputError("returned a dict whose keys are not all strings")
    return {name: as_array(name, value) for name, value in result.items()}


def infer_fields(result: object) -> tuple[FieldSpec, ...]:
    """The batch fields a return value makes, in its order (what the probe reports at start)."""
    arrays = _arrays(result)
    if not arrays:
        raise OutputError("returned an empty dict: a batch needs at least one field")
    try:
        return tuple(
            FieldSpec(name, a.dtype.name, tuple(int(d) for d in a.shape)) for name, a in arrays.items()
        )
    except ValueError as exc:
        raise OutputError(str(exc)) from None


def describe(name: str, array: npt.NDArray[Any]) -> str:
    return f"{name} {array.dtype.name}[{', '.join(map(str, array.shape))}]"


def store_output(result: object, fields: tuple[FieldSpec, ...], rows: Mapping[str, npt.NDArray[Any]]) -> None:
    """Check ``result`` against ``fields`` (exactly their names, shapes and dtypes: no casts), then
    copy each into ``rows[name]``, its row of the slot. OutputError naming the first mismatch."""
    arrays = _arrays(result)
    names = [f.name for f in fields]
    for f in fields:
        if f.name not in arrays:
            raise OutputError(f"no field {f.name!r} (the batch has {', '.join(names)})")
        got = arrays[f.name]
        if got.dtype.name != f.dtype or got.shape != f.shape:
            raise OutputError(f"field {describe(f.name, got)}, the batch has {f.describe()}")
    extra = [name for name in arrays if name not in names]
    if extra:
        raise OutputError(f"field {extra[0]!r} is not in the batch ({', '.join(names)})")
    for f in fields:
        np.copyto(rows[f.name], arrays[f.name])


def run_into(
    fn: Pipeline,
    sample: Sample,
    seed: int,
    fields: tuple[FieldSpec, ...],
    rows: Mapping[str, npt.NDArray[Any]],
) -> str | None:
    """Run the pipeline on one sample into its rows: None, or the reason the sample is bad
    (NOTE [ Pipeline failures are data ])."""
    try:
        store_output(call_pipeline(fn, sample, seed), fields, rows)
    except DecodeError as exc:  # the sample's own file, read through the mapping
        return one_line(str(exc))
    except StoreUnavailable:
        raise  # the data's store, not the sample: its task is done again (NOTE [ Object store reads ])
    except OutputError as exc:
        return one_line(f"{PIPELINE_REASON}{exc}")
    except (Exception, SystemExit) as exc:
        return one_line(f"{PIPELINE_REASON}{failure(exc)}")
    return None


def failure(exc: BaseException) -> str:
    """``ValueError: message``, or the bare type when the message is empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return (lines[0] if lines else text)[:MAX_REASON]
