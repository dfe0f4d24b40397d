"""Encoded rows on a real GPU (issue 46): nvJPEG through torchvision decodes them into the staged device
rows. Skipped where no CUDA GPU is visible, or where this torchvision cannot decode on one.

The pixels are not the CPU decode's byte for byte (NOTE [ The GPU decoder's memory ] in
gpu_worker/gpu_rows.py says why): the samples, labels and crops are, and the mean difference per
sample is printed and bounded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker import ServiceLoader
from gpu_worker.gpu_rows import gpu_decoder
from tests.helpers import ServiceFactory

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
    ),
]
ROOM = 1 << 20
MEAN_LEVELS = 6.0
"""The most mean absolute difference per sample, in levels of 255, allowed between nvJPEG with torch's
resize and libjpeg-turbo with the service's: different IDCTs and filters, the same crop."""


def host_epoch(loader: ServiceLoader, number: int) -> dict[int, tuple[int, torch.Tensor]]:
    loader.set_epoch(number)
    out: dict[int, tuple[int, torch.Tensor]] = {}
    for batch in loader:
        images = batch.images.to("cpu", copy=True)
        for row, (i, label) in enumerate(zip(batch.indices.tolist(), batch.labels.tolist(), strict=True)):
            out[i] = (int(label), images[row])
    return out


def test_the_gpu_decodes_the_same_samples_and_crops_and_memory_stays_flat(
    photos: Path, start_service: ServiceFactory
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    if gpu_decoder(device) is None:
        pytest.skip("this torchvision cannot decode JPEGs on the GPU")
    service = start_service(photos, batch_size=8, image_size=64, encoded_row_bytes=ROOM)
    with ServiceLoader(service.endpoint, device="cpu", timeout=60) as reference:
        expected = host_epoch(reference, 2)
    peaks = []
    with ServiceLoader(service.endpoint, device="cuda", decode="trainer", timeout=60) as loader:
        got = host_epoch(loader, 2)
        for number in range(3, 13):
            host_epoch(loader, number)
            peaks.append(torch.cuda.max_memory_allocated(device))
        decode = loader.stats()["decode"]
    assert sorted(got) == sorted(expected)
    assert all(got[i][0] == expected[i][0] for i in got), "labels"
    diffs = [(got[i][1].float() - expected[i][1].float()).abs().mean().item() for i in got]
    print(
        f"GPU decode against the service's: mean |difference| {sum(diffs) / len(diffs):.2f} levels, "
        f"worst sample {max(diffs):.2f}; peak GPU memory {peaks[-1] / 2**20:.1f} MiB; {decode}"
    )
    assert max(diffs) < MEAN_LEVELS, "the same crop and flip, only the decoder and filter differ"
    assert decode["trainer_rows"] > 0 and decode["spoiled"] == 0, decode
    assert peaks[-1] == peaks[2], f"GPU memory grew over ten epochs: {peaks}"
