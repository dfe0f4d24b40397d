"""Where a trainer's batches come from: the mapped slot pool (shm) or the socket (tcp), and the device.

``Delivery`` owns the trainer's view of one session's pool: it maps the announced segment (or, where
that cannot be done, chooses TCP), pins it for CUDA, and turns each announced batch into a ``Batch``
whose lease ends when its tensors are freed (NOTE [ Slot lifecycle ]).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import numpy.typing as npt
import torch
import zmq

from gpu_worker.batch import Batch, frame_fields, slot_fields
from gpu_worker.connection import ServiceError
from gpu_worker.device import CudaStager
from gpu_worker.gpu_rows import GpuRows, gpu_decoder
from gpu_worker.leases import Lease, LeaseBook
from gpu_worker.loop_clock import LoopClock
from gpu_worker.mapping import SlotMap
from gpu_worker.row_decoder import Bad, Pending, RowDecoder
from protocol.encoded import COLUMNS, LENGTH, MAX_PIXELS, OFFSET, bytes_named
from protocol.layout import SlotLayout, describe_fields
from protocol.messages import BatchReady, FeedInfo

log = logging.getLogger(__name__)


class Delivery:
    def __init__(
        self,
        device: torch.device,
        want: str,
        leases: LeaseBook,
        decoder: RowDecoder | None = None,
        timeout: float = 60.0,
    ) -> None:
        """``decoder``: the loader's, which decodes encoded rows (None: the service decodes every
        row); ``timeout``: the most seconds a batch's rows may take to decode."""
        self.device = device
        self._want = want
        self._leases = leases
        self._decoder = decoder or RowDecoder("service", 1, LoopClock())
        self._timeout = timeout
        self._pending: dict[Lease, Pending] = {}
        """Batches whose encoded rows are being decoded, by lease (NOTE [ Encoded rows ])."""
        self._gpu: GpuRows | None = None
        self._max_pixels = MAX_PIXELS
        """The largest image an encoded row may name: the service's own limit."""
        """The GPU's JPEG engine, where the device is CUDA and torchvision can use it."""
        self.spoiled: list[tuple[int, str]] = []
        """(sample, why) of encoded rows that could not be decoded, for the service to be told."""
        self._slots: SlotMap | None = None
        self.stager: CudaStager | None = None
        self._pinned_slots = 0
        """Slots ``[0, this)`` are pinned for CUDA copies."""
        self.transport = "shm"
        """``shm`` (the slot mapped in place) or ``tcp`` (bytes over the socket)."""
        self._offsets: npt.NDArray[np.int64] | None = None
        """Where each named source's samples begin in the feed's numbering, the feed's size last."""

    def adopt(self, info: FeedInfo, owner: int | None = None) -> None:
        """A (new) session's pool: map it, or choose TCP; pin it for CUDA. ``owner``: the uid the
        pool's segment must have (the service's, where known: NOTE [ A service's identity ])."""
        old = self._slots
        try:
            self._layout = SlotLayout.from_wire(info.batch_size, info.fields, info.encoded)
        except ValueError as exc:
            raise ServiceError(f"the service announced an unusable slot layout: {exc}") from None
        if info.encoded and not _encodable(self._layout):
            raise ServiceError(
                "the service offers encoded rows for a batch without an image field uint8[3, S, S]: "
                f"{describe_fields(self._layout.fields)}"
            )
        self._max_pixels = _max_pixels(info.decoding)
        self._offsets = _offsets(info)
        self._abandon_all()  # the old pool's batches: nothing may write into it from here
        self._slots = self._map(info, owner)
        self.transport = "tcp" if self._slots is None else "shm"
        if old is not None:
            old.close()  # unmaps once the batches still viewing it are gone
        if self.stager is not None:
            self.stager.unpin()  # the old pool's ranges, before its mapping can go
        self._pinned_slots = 0
        if self._slots is not None and self.device.type == "cuda":
            self.stager = self.stager or CudaStager(self.device)
        # The GPU's engine takes a mapped pool's rows; received ones (tcp) are decoded on the CPU.
        self._gpu = None
        if self._decoding and self._slots is not None and (decode := gpu_decoder(self.device)) is not None:
            self._gpu = GpuRows(self.device, decode, self._max_pixels)

    def _map(self, info: FeedInfo, owner: int | None) -> SlotMap | None:
        """The announced pool, mapped and checked; None where ``auto`` finds it cannot be (TCP)."""
        if self._want == "tcp":
            return None
        try:
            return SlotMap(info.segment, self._layout, info.slots, info.check, owner)
        except (ValueError, OSError) as exc:
            if self._want == "auto":
                log.info("cannot map the service's pool here (%s); batches will come over the socket", exc)
                return None
            # Never map memory a message merely names: only our own segments, whole, as announced.
            raise ServiceError(f"the service announced an unusable slot pool: {exc}") from None

    @property
    def layout(self) -> SlotLayout:
        """The current session's batch layout: its fields and their place in a slot."""
        return self._layout

    @property
    def batch_bytes(self) -> int:
        """Bytes a full batch brings over the socket: 0 where batches are mapped in place."""
        if self.transport != "tcp":
            return 0
        layout = self._layout
        encoded = layout.stride - layout.table_offset if layout.encoded else 0  # the table and its bytes
        return sum(nbytes for _, nbytes in layout.parts(layout.capacity)) + encoded

    @property
    def _decoding(self) -> bool:
        """Whether this trainer decodes the rows the feed sends encoded (NOTE [ Encoded rows ])."""
        return bool(self._layout.encoded) and self._decoder.takes_encoded

    def prepare(self, msg: BatchReady, lease: Lease, frames: list[zmq.Frame] | None) -> None:
        """The batch arrived: begin decoding its encoded rows now, while the loop trains on the ones
        before it (``wrap`` waits for them)."""
        if self._gpu is not None:
            return  # decoded on the device once staged (``wrap``)
        if self._decoding and lease not in self._pending and 0 < msg.count <= self._layout.capacity:
            try:
                pending = self._begin(msg, frames)
            except (ValueError, ServiceError):
                return  # ``wrap`` says what is wrong with it
            if pending is not None:
                self._pending[lease] = pending

    def forget(self, lease: Lease) -> None:
        """A batch the loop will not see: nothing writes into it once it goes back."""
        pending = self._pending.pop(lease, None)
        if pending is not None:
            self._decoder.abandon(pending)

    def _abandon_all(self) -> None:
        for lease in list(self._pending):
            self.forget(lease)

    def _begin(self, msg: BatchReady, frames: list[zmq.Frame] | None) -> Pending | None:
        """Start decoding the batch's encoded rows: into its slot (shm), or into a copy of the image
        rows that arrived (tcp, whose frames are read-only)."""
        layout, count = self._layout, msg.count
        image_spec = layout.field("image")
        if self._slots is not None:
            owner = self._slots.slot(msg.slot)
            view = memoryview(owner)
            table, area = self._encoded_views(view, count)
            offset = layout.offsets[layout.names.index("image")]
            image = np.frombuffer(view, np.uint8, count * image_spec.row_bytes, offset)
            shape = image.reshape(count, *image_spec.shape)
            return self._decoder.start(table.copy(), area, shape, owner, self._max_pixels)
        data, table_frame, area_frame = _split_frames(frames, layout, count)
        table = np.frombuffer(table_frame.buffer, np.int64).reshape(count, COLUMNS).copy()
        area = np.frombuffer(area_frame.buffer, np.uint8)
        received = np.frombuffer(data[layout.names.index("image")].buffer, np.uint8)
        image = received.reshape(count, *image_spec.shape).copy()
        return self._decoder.start(table, area, image, area_frame, self._max_pixels)

    def _decoded(
        self, msg: BatchReady, lease: Lease, frames: list[zmq.Frame] | None
    ) -> tuple[Pending | None, Bad]:
        """The batch's encoded rows, decoded (waiting for what ``prepare`` began), and the bad ones."""
        if not self._decoding or self._gpu is not None:
            return None, []
        pending = self._pending.pop(lease, None)
        if pending is None:
            try:
                pending = self._begin(msg, frames)
            except ValueError as exc:
                raise ServiceError(f"malformed batch from the service: {exc}") from None
        if pending is None:
            return None, []
        try:
            return pending, self._decoder.finish(pending, self._timeout)
        except TimeoutError:
            self._decoder.abandon(pending)
            raise ServiceError(
                f"decoding batch {msg.seq}'s encoded rows took over {self._timeout:.0f} s"
            ) from None

    def wrap(self, msg: BatchReady, lease: Lease, frames: list[zmq.Frame] | None) -> Batch:
        if self._slots is None:
            return self._from_frames(msg, lease, frames)
        try:
            owner = self._slots.slot(msg.slot)
        except ValueError as exc:
            self.forget(lease)
            raise ServiceError(f"service announced an invalid slot: {exc}") from None
        self._leases.watch(owner, lease)
        try:
            _, bad = self._decoded(msg, lease, None)
        except BaseException:
            del owner
            raise
        fields, indices = slot_fields(memoryview(owner), self._slots.layout, msg.count)
        table = self._table(owner, msg.count) if self._gpu is not None else None
        del owner  # from here on only the views keep the slot (and so the lease)
        fields, indices = self._without(bad, fields, indices)
        if self.stager is not None:
            self._pin_through(self.stager, self._slots, msg.slot)
            host = tuple(fields.values())
            fields = dict(zip(fields, self.stager.stage(host, keep_alive=host), strict=True))
        if table is not None and self._gpu is not None:
            fields, indices = self._on_device(self._gpu, fields, indices, *table)
        return self._batch(fields, indices, msg)

    def _table(self, owner: object, count: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
        """A copy of the slot's table rows and its byte area (read before the slot can go back)."""
        table, area = self._encoded_views(memoryview(owner), count)  # type: ignore[arg-type]
        end = bytes_named(table[:, OFFSET].tolist(), table[:, LENGTH].tolist(), len(area))
        return table.copy(), area[:end].copy()

    def _encoded_views(
        self, view: memoryview, count: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
        """A mapped slot's table rows ``[count, COLUMNS]`` and its whole byte area, as views."""
        layout = self._layout
        table = np.frombuffer(view, np.int64, count * COLUMNS, layout.table_offset).reshape(count, COLUMNS)
        return table, np.frombuffer(view, np.uint8, layout.encoded_area, layout.bytes_offset)

    def _on_device(
        self,
        gpu: GpuRows,
        fields: dict[str, torch.Tensor],
        indices: torch.Tensor,
        table: npt.NDArray[np.int64],
        area: npt.NDArray[np.uint8],
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The encoded rows decoded by the GPU's engine into the staged image rows."""
        began = time.perf_counter()
        bad, made = gpu.decode_into(fields["image"], table, area)
        self._decoder.counted(made, len(bad), time.perf_counter() - began)
        return self._without(bad, fields, indices)

    def _without(
        self, bad: Bad, fields: dict[str, torch.Tensor], indices: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The batch without the rows that could not be decoded (copies of the rest), each noted
        for the service with its sample: one bad file costs its row, never the batch."""
        if not bad:
            return fields, indices
        samples = indices.tolist()
        self.spoiled += [(samples[row], why) for row, why in bad]
        keep = torch.from_numpy(np.setdiff1d(np.arange(len(samples)), [row for row, _ in bad]))
        kept = {name: t.index_select(0, keep.to(t.device)) for name, t in fields.items()}
        return kept, indices.index_select(0, keep)

    def _pin_through(self, stager: CudaStager, slots: SlotMap, slot: int) -> None:
        """Pin the slots up to ``slot``: every slot below an announced one is backed by memory (NOTE
        [ A pool as large as what is in flight ] in loader_service/supervisor/slots.py), and the
        ones above it may not be yet, so registering them would make tmpfs allocate them."""
        if slot < self._pinned_slots:
            return
        stride = slots.layout.stride
        stager.pin(slots.address + self._pinned_slots * stride, (slot + 1 - self._pinned_slots) * stride)
        self._pinned_slots = slot + 1

    def empty(self, msg: BatchReady) -> Batch:
        """A batch whose every sample was bad (NOTE [ Empty batches ] in gpu_worker/passes.py): the
        feed's fields with no rows, on the loader's device."""
        fields = {
            spec.name: torch.from_numpy(np.empty((0, *spec.shape), spec.dtype)).to(self.device)
            for spec in self._layout.fields
        }
        return Batch(fields, torch.empty(0, dtype=torch.int64), msg.epoch, msg.seq)

    def _from_frames(self, msg: BatchReady, lease: Lease, frames: list[zmq.Frame] | None) -> Batch:
        """TCP: tensors view the received frames (no copy on CPU); the lease ends with them."""
        if frames is None:
            raise ServiceError(f"batch {msg.seq} arrived without its data")
        pending, bad = self._decoded(msg, lease, frames)
        try:
            fields, indices = frame_fields(
                _split_frames(frames, self._layout, msg.count)[0], self._layout, msg.count
            )
        except ValueError as exc:
            raise ServiceError(f"malformed batch from the service: {exc}") from None
        if pending is not None:  # the rows decoded here, in their writable copy
            fields["image"] = torch.from_numpy(pending.image)
        fields, indices = self._without(bad, fields, indices)
        self._leases.watch_all(frames, lease)
        del frames  # from here on only the views keep their frames (and so the lease)
        if self.device.type == "cuda":
            fields = dict(zip(fields, self._to_device(tuple(fields.values())), strict=True))
        return self._batch(fields, indices, msg)

    def _batch(self, fields: dict[str, torch.Tensor], indices: torch.Tensor, msg: BatchReady) -> Batch:
        """The batch, each row's feed sample split into its source and its sample there (NOTE
        [ Sources of a feed ] in loader_service/dataset/sources.py)."""
        offsets = self._offsets
        if offsets is None:
            return Batch(fields, indices, msg.epoch, msg.seq)
        feed = indices.numpy()
        if feed.size and not 0 <= int(feed.min()) <= int(feed.max()) < int(offsets[-1]):
            raise ServiceError(f"batch {msg.seq} names samples outside the feed's {int(offsets[-1])}")
        source = np.searchsorted(offsets, feed, side="right") - 1
        local = torch.from_numpy(feed - offsets[source])
        return Batch(fields, local, msg.epoch, msg.seq, torch.from_numpy(source.astype(np.int64)))

    def _to_device(self, host: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Received bytes -> pinned staging buffers -> the device, on the side stream as for shm.

        Pinned buffers come from torch's caching host allocator, which hands a block out again only
        after the copy that used it has completed, so this is no allocation per batch.
        """
        self.stager = self.stager or CudaStager(self.device)
        pinned = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in host)
        return self.stager.stage(pinned, keep_alive=pinned)

    def collect(self) -> None:
        """Let go of host batches whose device copies have completed."""
        if self.stager is not None:
            self.stager.collect()

    def abandon_all(self) -> None:
        """Every batch being decoded is given up, and nothing writes into its slot from here: before
        a bye, which frees every slot of the session at once."""
        self._abandon_all()

    def close(self) -> None:
        self._abandon_all()
        if self.stager is not None:
            self.stager.close()
        if self._slots is not None:
            self._slots.close()


def _encodable(layout: SlotLayout) -> bool:
    """Whether the layout has the built-in image field that encoded rows are decoded into."""
    if "image" not in layout.names:
        return False
    image = layout.field("image")
    return (
        image.dtype == "uint8"
        and len(image.shape) == 3
        and image.shape[0] == 3
        and image.shape[1] == image.shape[2]
    )


def _max_pixels(decoding: str) -> int:
    """The service's pixel limit (``max-pixels=N`` in ``FeedInfo.decoding``), at most ``MAX_PIXELS``:
    no encoded row may name a larger image, so no decode here allocates more than the service's would."""
    for word in decoding.split():
        key, _, value = word.partition("=")
        if key == "max-pixels" and value.isdigit() and int(value) > 0:
            return min(int(value), MAX_PIXELS)
    return MAX_PIXELS


def _split_frames(
    frames: list[zmq.Frame] | None, layout: SlotLayout, count: int
) -> tuple[list[zmq.Frame], zmq.Frame, zmq.Frame]:
    """A received batch's frames: its fields' and indices' (``frame_fields`` reads them), then, for a
    feed that offers encoded rows, the table's ``count`` rows and the bytes they name. ValueError
    where there are not as many, or the table is not ``count`` rows."""
    if frames is None:
        raise ValueError("a batch without its data")
    if not layout.encoded:
        return frames, frames[-1], frames[-1]
    if len(frames) != len(layout.fields) + 3:
        raise ValueError(
            f"{len(frames)} data frames where a feed with encoded rows sends {len(layout.fields) + 3}"
        )
    table = frames[-2]
    if len(table.buffer) != count * COLUMNS * 8:
        raise ValueError(f"an encoded-row table of {len(table.buffer)} bytes for {count} rows")
    return frames[:-2], table, frames[-1]


def _offsets(info: FeedInfo) -> npt.NDArray[np.int64] | None:
    """Where each of the feed's named sources begins, and the feed's size last; None for a feed of
    ``--data``. The sizes come from a peer: one per source, each counted as a batch row's index is."""
    if not info.sources:
        return None
    if len(info.source_sizes) != len(info.sources):
        raise ServiceError(
            f"the service announced {len(info.sources)} sources and {len(info.source_sizes)} sizes"
        )
    return np.concatenate(([0], np.cumsum(info.source_sizes))).astype(np.int64)
