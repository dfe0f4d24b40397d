"""The ``Batch`` a trainer's loop receives: tensors viewing one leased slot of the shared pool."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import zmq

from protocol.layout import SlotLayout


class Batch:
    """One delivered batch. Unpacks as ``images, labels`` like a DataLoader batch.

    ``images``: uint8 ``[n, 3, S, S]``; ``labels`` and ``indices`` (positions in the service's dataset
    index): int64 ``[n]``. On CPU, ``images`` views shared memory; its slot is returned to the service
    when the last tensor viewing it is freed.
    """

    __slots__ = ("epoch", "images", "indices", "labels", "seq")

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, epoch: int, seq: int
    ):
        self.images = images
        self.labels = labels
        self.indices = indices
        self.epoch = epoch
        self.seq = seq

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.images, self.labels))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.images, self.labels)[i]

    def __repr__(self) -> str:
        return f"Batch(epoch={self.epoch}, seq={self.seq}, images={tuple(self.images.shape)})"


def slot_tensors(
    view: memoryview, layout: SlotLayout, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``images`` viewing the slot, and copies of its labels and indices.

    numpy keeps ``view.obj`` (the slot's owner, see ``SlotMap.slot``) as the base of ``images``, so
    the slot lives exactly as long as ``images`` and the tensors made from it.

    The small arrays are copied so that only ``images`` pins the slot: a loop that keeps labels
    around does not hold a credit.
    """
    pixels = np.frombuffer(view, np.uint8, count * layout.image_bytes, 0)
    images = torch.from_numpy(pixels.reshape(count, *layout.image_shape))
    labels = torch.from_numpy(np.frombuffer(view, np.int64, count, layout.labels_offset).copy())
    indices = torch.from_numpy(np.frombuffer(view, np.int64, count, layout.indices_offset).copy())
    return images, labels, indices


def frame_tensors(
    frames: list[zmq.Frame], layout: SlotLayout, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``images`` viewing the received images frame, and copies of the labels and indices frames.

    Each frame must hold exactly ``count`` rows; ValueError otherwise (the bytes come off a network).
    numpy keeps the frame (through its buffer) as the base of ``images``.
    """
    sizes = (count * layout.image_bytes, 8 * count, 8 * count)
    images_frame, labels_frame, indices_frame = frames
    got = tuple(len(f.buffer) for f in frames)
    if got != sizes:
        raise ValueError(f"frames of {got} bytes where {count} rows take {sizes}")
    pixels = np.frombuffer(images_frame.buffer, np.uint8)
    images = torch.from_numpy(pixels.reshape(count, *layout.image_shape))
    labels = torch.from_numpy(np.frombuffer(labels_frame.buffer, np.int64).copy())
    indices = torch.from_numpy(np.frombuffer(indices_frame.buffer, np.int64).copy())
    return images, labels, indices
