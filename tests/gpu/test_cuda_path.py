"""The CUDA path on a real GPU: pinning, side-stream copies, slot release on the copy's event, leaks.

Where ``torch.cuda.is_available()`` is false (CI, and most of this project's machines) the whole
module is skipped; it passed on an H100 with torch 2.11. The stager tests use an anonymous mapping in
place of a slot segment; the service tests attach ``ServiceLoader(device="cuda")`` to a real service.
"""

from __future__ import annotations

import ctypes
import mmap
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import ServiceLoader
from gpu_worker.device import CudaStager, last_error_clearer
from protocol.layout import SlotLayout
from tests.helpers import ServiceFactory, status

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False here"
)

POOL_BYTES = 1 << 20
SIDE_STREAM_SLEEP_CYCLES = 200_000_000  # about 0.1 s at GPU clocks: far longer than stage() takes
BATCHES = 1000


class Owner:
    """Stands in for a batch's slot: the lease ends when this object dies."""


@pytest.fixture
def pool() -> Iterator[tuple[int, torch.Tensor]]:
    """An anonymous shared mapping like a slot segment: its address, and a uint8 tensor over it."""
    region = mmap.mmap(-1, POOL_BYTES)
    host = torch.frombuffer(region, dtype=torch.uint8)
    host.copy_(torch.arange(POOL_BYTES) % 251)
    yield host.data_ptr(), host
    # The mapping goes when the last view of it does (after the test has closed its stagers).


def test_copy_on_the_side_stream_keeps_the_host_batch_until_its_event(
    pool: tuple[int, torch.Tensor],
) -> None:
    address, host = pool
    device = torch.device("cuda", torch.cuda.current_device())
    stager = CudaStager(device)
    try:
        stager.pin(address, POOL_BYTES)
        assert host.is_pinned(), "the whole mapping is registered"
        # Labels from the pinned pool too: a pageable source may make the copy wait for the stream.
        images, labels = host[: 8 * 3 * 32 * 32].view(8, 3, 32, 32), host[-64:].view(torch.int64)
        expected, expected_labels = images.clone(), labels.clone()
        owner = Owner()
        alive = weakref.ref(owner)
        # Hold the side stream back, so the copy queued behind it is certainly still pending.
        with torch.cuda.stream(stager._stream):
            torch.cuda._sleep(SIDE_STREAM_SLEEP_CYCLES)
        on_device, device_labels = stager.stage([images, labels], keep_alive=owner)
        del owner
        seen = on_device.clone()  # queued on the current stream, which must wait for the copy
        stager.collect()
        assert alive() is not None, "the host batch was dropped before its copy completed"
        torch.cuda.synchronize()
        stager.collect()
        assert alive() is None, "the host batch outlived its completed copy"
        assert on_device.device == device and torch.equal(seen.cpu(), expected)
        assert torch.equal(device_labels.cpu(), expected_labels)
    finally:
        stager.close()
    assert not host.is_pinned(), "close() unregisters the mapping"


def test_a_failed_registration_does_not_break_the_next_kernel(pool: tuple[int, torch.Tensor]) -> None:
    if last_error_clearer(torch.cuda.cudart()) is None:
        # The failure would then (by design) raise and leave CUDA's last error set for this process.
        pytest.skip("nothing here clears CUDA's last error; tests/unit/test_device_errors.py covers it")
    address, host = pool
    device = torch.device("cuda", torch.cuda.current_device())
    first, second = CudaStager(device), CudaStager(device)
    try:
        first.pin(address, POOL_BYTES)
        second.pin(address, POOL_BYTES)  # the same range again: cudaErrorHostMemoryAlreadyRegistered
        assert torch.ones(8, device=device).sum().item() == 8, "the failure was left for a kernel"
        assert host.is_pinned()
    finally:
        second.close()  # registered nothing, so unregisters nothing
        first.close()
    assert not host.is_pinned()


# --- through a real service ----------------------------------------------------------------------


def copied(loader: ServiceLoader) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """One epoch as host copies; ``to(copy=True)`` so CPU batches do not keep their slots."""
    out = []
    for batch in loader:
        assert {t.device.type for t in batch.values()} == {loader.device.type}, "every field is moved"
        assert batch.indices.device.type == "cpu"
        out.append(
            (batch.indices.tolist(), batch.labels.to("cpu", copy=True), batch.images.to("cpu", copy=True))
        )
    return out


@pytest.mark.integration
def test_cuda_batches_equal_cpu_batches(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, seed=5)
    epochs = []
    for device in ("cpu", "cuda"):
        with ServiceLoader(service.endpoint, device=device, timeout=30) as loader:
            loader.set_epoch(3)
            epochs.append(copied(loader))
    on_cpu, on_cuda = epochs
    assert len(on_cuda) == len(on_cpu) > 0
    for (cpu_indices, cpu_labels, cpu_images), (indices, labels, images) in zip(on_cpu, on_cuda, strict=True):
        assert indices == cpu_indices
        assert torch.equal(labels, cpu_labels)
        assert torch.equal(images, cpu_images), "the same (seed, epoch) must give the same pixels"


@pytest.mark.integration
def test_a_fleet_on_cuda_gives_the_batches_one_service_gives_on_cpu(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Each service of a fleet has its own pool, pinned and copied on its own side stream."""
    one = start_service(photos, seed=5, name="one")
    two = start_service(photos, seed=5, name="two", workers=1)
    with ServiceLoader(one.endpoint, device="cpu", timeout=30) as loader:
        loader.set_epoch(2)
        expected = copied(loader)
    with ServiceLoader([one.endpoint, two.endpoint], device="cuda", timeout=30) as loader:
        loader.set_epoch(2)
        got = copied(loader)
        shares = [share["batches"] for share in loader.stats()["endpoints"].values()]
    assert len(got) == len(expected) > 0 and all(shares), shares
    for (indices, labels, images), (cpu_indices, cpu_labels, cpu_images) in zip(got, expected, strict=True):
        assert indices == cpu_indices
        assert torch.equal(labels, cpu_labels) and torch.equal(images, cpu_images)


def wait_until_no_slot_is_leased(endpoint: str, timeout: float = 10.0) -> dict[str, Any]:
    """The service's status once every lease has come back (releases travel asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        body = status(endpoint)
        leased = body["feeds"][0]["slots"]["leased"], [s["leased"] for s in body["sessions"]]
        if leased[0] == 0 and not any(leased[1]):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"slots still leased (pool, per session): {leased}")
        time.sleep(0.1)


@pytest.mark.integration
def test_a_thousand_batches_pin_each_slot_once_and_leak_nothing(
    photos: Path, start_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pins: list[tuple[int, int]] = []
    real_pin = CudaStager.pin

    def counting_pin(self: CudaStager, address: int, nbytes: int) -> None:
        pins.append((address, nbytes))
        real_pin(self, address, nbytes)

    monkeypatch.setattr(CudaStager, "pin", counting_pin)
    service = start_service(photos, batch_size=8, image_size=32)
    allocated = []  # device memory in use at the first batch of each epoch
    batches = 0
    with ServiceLoader(service.endpoint, device="cuda", timeout=30) as loader:
        epochs = -(-BATCHES // len(loader))  # whole epochs, so no batch is left in flight at the end
        for _ in range(epochs):
            for batch in loader:
                # A training step; its .item() waits for the copy, so the next fetch releases the slot.
                batch.images.float().mean().item()
                if batch.seq == 0:
                    allocated.append(torch.cuda.memory_allocated(loader.device))
                batches += 1
        assert batches >= BATCHES
        # NOTE [ A pool as large as what is in flight ]: ranges registered as slots appear, each once.
        ends = [address + nbytes for address, nbytes in pins]
        assert all(pins[i + 1][0] == ends[i] for i in range(len(pins) - 1)), f"ranges overlap: {pins}"
        body = wait_until_no_slot_is_leased(service.endpoint)  # while the session lasts: closing returns all
        slots = sum(body["feeds"][0]["slots"].values())
        assert len(pins) <= slots, f"registered per batch, not per new slot: {len(pins)} ranges"
        first, whole = pins[0][0], ends[-1] - pins[0][0]
        assert whole <= slots * SlotLayout.images(8, 32).stride, "pinned beyond the slots backed by memory"
        pool = torch.frombuffer((ctypes.c_uint8 * whole).from_address(first), dtype=torch.uint8)
        assert pool.is_pinned(), "the pool stayed registered"
        del pool
    assert allocated[1:] == [allocated[1]] * (len(allocated) - 1), f"device memory grew: {allocated}"
