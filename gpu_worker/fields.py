"""The fields a trainer expects of a feed (``ServiceLoader(fields=...)``), and how they differ from it.

    fields={"image": ((3, 224, 224), torch.uint8), "label": ((), torch.int64)}

Each entry is a field's name, then the shape of one sample's value (``()`` for a scalar) and its
dtype (a ``torch.dtype``, or its name). The feed announces its own fields in the welcome; a trainer
that stated others gets one error naming every difference, before any batch is taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from protocol.layout import DTYPES, FieldSpec

ExpectedFields = Mapping[str, tuple[Sequence[int], torch.dtype | str]]
"""Field name -> (shape of one sample, dtype), in the order the batch unpacks."""

_DTYPE_NAMES = {getattr(torch, name): name for name in DTYPES}


def expected_fields(fields: ExpectedFields) -> tuple[FieldSpec, ...]:
    """``fields`` as the layout's field specs; ValueError naming the entry that is not one."""
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError("fields must be a non-empty dict of name -> (shape, dtype)")
    return tuple(_spec(name, value) for name, value in fields.items())


def _spec(name: str, value: object) -> FieldSpec:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(f"fields[{name!r}] must be (shape, dtype), e.g. ((3, 224, 224), torch.uint8)")
    shape, dtype = value
    if not isinstance(shape, tuple | list):
        raise ValueError(f"fields[{name!r}]: shape must be a tuple of sizes (() for a scalar), not {shape!r}")
    return FieldSpec(name, _dtype_name(name, dtype), tuple(shape))


def _dtype_name(name: str, dtype: object) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"fields[{name!r}]: {dtype} is not a field dtype ({', '.join(DTYPES)})")
        return _DTYPE_NAMES[dtype]
    if isinstance(dtype, str):
        return dtype  # FieldSpec names the valid ones if this is not one of them
    raise ValueError(f"fields[{name!r}]: dtype must be a torch.dtype or its name, not {dtype!r}")


def field_differences(expected: Sequence[FieldSpec], served: Sequence[FieldSpec]) -> list[str]:
    """Every way ``served`` (the feed's fields) differs from ``expected``; empty if it does not."""
    mine = {f.name: f for f in expected}
    theirs = {f.name: f for f in served}
    differences = [f"missing field {f.describe()}" for f in expected if f.name not in theirs]
    differences += [f"extra field {f.describe()}" for f in served if f.name not in mine]
    for want in expected:
        got = theirs.get(want.name)
        if got is not None and got.shape != want.shape:
            differences.append(f"{want.name}: shape {list(got.shape)}, expected {list(want.shape)}")
        if got is not None and got.dtype != want.dtype:
            differences.append(f"{want.name}: dtype {got.dtype}, expected {want.dtype}")
    # A batch unpacks in the feed's order: the same fields in another order would be swapped silently.
    common_mine = [f.name for f in expected if f.name in theirs]
    common_theirs = [f.name for f in served if f.name in mine]
    if common_mine != common_theirs:
        differences.append(f"order {', '.join(common_theirs)}, expected {', '.join(common_mine)}")
    return differences


def as_expected(fields: Sequence[FieldSpec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``fields`` in the form ``ServiceLoader(fields=...)`` takes: what to paste into a trainer."""
    return {f.name: (f.shape, getattr(torch, f.dtype)) for f in fields}
