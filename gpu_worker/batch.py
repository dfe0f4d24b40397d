"""The ``Batch`` a trainer's loop receives: the named fields of one leased slot of the shared pool.

NOTE [ Batch fields: views and copies ]
    A field whose rows are larger than ``SMALL_ROW_BYTES`` (images, feature maps) is a zero-copy view:
    of the slot (shm) or of the received frame (tcp). Smaller ones (labels, scalars) and the indices
    are copied, so that only the big fields pin the slot: a loop that keeps labels around does not
    hold a credit. numpy keeps the buffer a view was made from as the base of the array torch wraps:
    for shm that is the one ``SlotMap.slot`` object every view of the batch shares, so the slot
    lives exactly as long as any view of it (NOTE [ Slot lifecycle ]); for tcp it is the field's own
    frame, and the lease waits for every frame (``LeaseBook.watch_all``).
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zmq

from protocol.layout import FieldSpec, SlotLayout

SMALL_ROW_BYTES = 64
"""Rows at most this large are copied out of the slot (NOTE [ Batch fields: views and copies ])."""


class Batch:
    """One delivered batch: its fields by name, in the feed's order, and where its samples came from.

    A mapping of field name to tensor (``batch["image"]``, ``keys()``, ``items()``, ``dict(batch)``,
    ``batch.fields``) that unpacks as a tuple of its fields, like a DataLoader batch::

        images, labels = batch          # the built-in transforms' fields: image, label

    Iterating therefore gives tensors, not names, so a ``Batch`` is not a ``collections.abc.Mapping``
    (generic code that walks a Mapping by its keys would get tensors): hand such code
    ``batch.fields``. ``batch[i]`` is the ``i``-th field. Every field is ``[n, *shape]``; ``sources``
    int64 ``[n]``: each row's source, a position in ``ServiceLoader.sources`` (0 for a feed of one
    source); ``indices`` int64 ``[n]``: each row's sample in its source's index; ``images`` /
    ``labels`` name the fields ``image`` / ``label`` where the feed has them.
    """

    __slots__ = ("_fields", "epoch", "indices", "seq", "sources")

    def __init__(
        self,
        fields: dict[str, torch.Tensor],
        indices: torch.Tensor,
        epoch: int,
        seq: int,
        sources: torch.Tensor | None = None,
    ) -> None:
        self._fields = fields
        self.indices = indices
        self.epoch = epoch
        self.seq = seq
        self.sources = sources if sources is not None else torch.zeros_like(indices)

    @property
    def fields(self) -> dict[str, torch.Tensor]:
        """A new dict of the fields, in the feed's order."""
        return dict(self._fields)

    def keys(self) -> KeysView[str]:
        return self._fields.keys()

    def values(self) -> ValuesView[torch.Tensor]:
        return self._fields.values()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self._fields.items()

    def get(self, name: str, default: Any = None) -> Any:
        return self._fields.get(name, default)

    def __getitem__(self, key: str | int) -> torch.Tensor:
        if isinstance(key, int):
            return tuple(self._fields.values())[key]
        return self._fields[key]

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(tuple(self._fields.values()))

    def __len__(self) -> int:
        return len(self._fields)

    @property
    def images(self) -> torch.Tensor:
        return self._named("image")

    @property
    def labels(self) -> torch.Tensor:
        return self._named("label")

    def _named(self, name: str) -> torch.Tensor:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(
                f"this feed's batches have no field {name!r}; they have {', '.join(self._fields)}"
            ) from None

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}={_describe(t)}" for name, t in self._fields.items())
        return f"Batch(epoch={self.epoch}, seq={self.seq}, {shapes})"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def slot_fields(
    view: memoryview, layout: SlotLayout, count: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The first ``count`` rows of every field of a slot, and its indices.

    ``view`` covers one whole slot (``SlotMap.slot``); NOTE [ Batch fields: views and copies ].
    """
    fields = {
        spec.name: _rows(np.frombuffer(view, spec.dtype, count * _items(spec), offset), spec, count)
        for spec, offset in zip(layout.fields, layout.offsets, strict=True)
    }
    indices = np.frombuffer(view, np.int64, count, layout.indices_offset).copy()
    return fields, torch.from_numpy(indices)


def frame_fields(
    frames: list[zmq.Frame], layout: SlotLayout, count: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The fields and indices of a batch that came over the socket: one frame per field in the
    layout's order, then the indices (``SlotLayout.parts``).

    The bytes come off a network: every frame must hold exactly ``count`` rows; ValueError otherwise.
    """
    if len(frames) != len(layout.fields) + 1:
        raise ValueError(
            f"{len(frames)} data frames where {len(layout.fields)} fields and the indices take "
            f"{len(layout.fields) + 1}"
        )
    names = [*layout.names, "indices"]
    for name, frame, (_, nbytes) in zip(names, frames, layout.parts(count), strict=True):
        if len(frame.buffer) != nbytes:
            raise ValueError(
                f"frame {name!r} holds {len(frame.buffer)} bytes where {count} rows take {nbytes}"
            )
    fields = {
        spec.name: _rows(np.frombuffer(frame.buffer, spec.dtype), spec, count)
        for spec, frame in zip(layout.fields, frames[:-1], strict=True)
    }
    indices = np.frombuffer(frames[-1].buffer, np.int64).copy()
    return fields, torch.from_numpy(indices)


def _items(spec: FieldSpec) -> int:
    return spec.row_bytes // spec.itemsize


def _rows(flat: npt.NDArray[Any], spec: FieldSpec, count: int) -> torch.Tensor:
    """``[count, *shape]`` over ``flat``: a view if its rows are big, else a copy.

    A frame's memory is only as aligned as the allocator made it; a misaligned view is copied too.
    """
    rows = flat.reshape(count, *spec.shape)
    if spec.row_bytes <= SMALL_ROW_BYTES or not rows.flags.aligned:
        rows = rows.copy()
    return torch.from_numpy(rows)
