"""The core feed through real processes: a service subprocess, real ZeroMQ, real shared memory."""

from __future__ import annotations

import hashlib
import signal
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from gpu_worker import ServiceError, ServiceLoader, ServiceTimeout
from loader_service.config import FIRST_SLOTS
from loader_service.config.feed import AUTO_MOST_SLOTS
from loader_service.dataset.index import build_index
from loader_service.dataset.sampler import sample_rng
from loader_service.decode.contract import INTERPOLATIONS
from loader_service.decode.decoders import roi_decoder_version
from protocol.layout import PAGE
from protocol.pixels.geometry import eval_geometry, random_resized_crop_params
from protocol.pixels.regions import ROI_HEADROOM, roi_scale
from tests.helpers import ServiceFactory, in_background, our_segments, pool_bytes, slot_reserve, status

pytestmark = pytest.mark.integration


def collect_epoch(loader: ServiceLoader) -> list[tuple[list[int], list[int], str]]:
    """(indices, labels, sha1 of pixels) per batch of one epoch."""
    out = []
    for batch in loader:
        out.append(
            (
                batch.indices.tolist(),
                batch.labels.tolist(),
                hashlib.sha1(batch.images.numpy().tobytes()).hexdigest(),
            )
        )
    return out


def test_two_epochs_deliver_every_image_exactly_once_with_labels(
    photos: Path, start_service: ServiceFactory
) -> None:
    index = build_index(photos)
    service = start_service(photos, batch_size=8, image_size=32)
    orders = []
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        assert len(loader) == -(-len(index) // 8)
        for epoch_no in range(2):
            seen: list[int] = []
            batches = 0
            for b in loader:
                assert b.epoch == epoch_no
                assert b.images.shape[1:] == (3, 32, 32) and b.images.dtype == torch.uint8
                assert b.labels.tolist() == [int(index.labels[i]) for i in b.indices.tolist()]
                seen += b.indices.tolist()
                batches += 1
            assert batches == len(loader)
            assert sorted(seen) == list(range(len(index))), "each image exactly once per epoch"
            orders.append(seen)
    assert orders[0] != orders[1], "epochs are reshuffled"


def test_same_seed_gives_same_batches_whichever_worker_decodes(
    photos: Path, start_service: ServiceFactory
) -> None:
    runs = []
    for workers, name in ((1, "a"), (3, "b")):
        service = start_service(photos, workers=workers, seed=11, name=name)
        with ServiceLoader(service.endpoint, timeout=30) as loader:
            runs.append([collect_epoch(loader), collect_epoch(loader)])
        assert service.stop() == 0
    assert runs[0] == runs[1]

    other = start_service(photos, seed=12, name="c")
    with ServiceLoader(other.endpoint, timeout=30) as loader:
        assert collect_epoch(loader) != runs[0][0]


def epoch_pixels(loader: ServiceLoader) -> dict[int, np.ndarray]:
    return {
        idx: batch.images[row].numpy().copy()
        for batch in loader
        for row, idx in enumerate(batch.indices.tolist())
    }


@pytest.mark.skipif(roi_decoder_version() is None, reason="the region decoder is not built here")
def test_region_decoder_gives_the_pixels_of_a_full_decode(
    photos: Path, start_service: ServiceFactory
) -> None:
    # At 64 px a crop is decoded at reduced scale only when 384 px or more on both sides: those
    # samples must differ slightly (proving the workers took the region path), all others must have
    # exactly the full decode's pixels.
    runs = {}
    for decoder in ("jpeg-roi", "opencv"):
        service = start_service(photos, decoder=decoder, image_size=64, seed=3, name=decoder)
        service.wait_for(rf"decoder: {decoder} \(", 10)
        with ServiceLoader(service.endpoint, timeout=30) as loader:
            runs[decoder] = epoch_pixels(loader)
        assert service.stop() == 0
    assert runs["jpeg-roi"].keys() == runs["opencv"].keys() == set(range(len(build_index(photos))))
    index = build_index(photos)
    scaled: list[float] = []
    for idx, pixels in runs["opencv"].items():
        difference = np.abs(runs["jpeg-roi"][idx].astype(int) - pixels).mean()
        height, width = cv2.imread(str(index.path(idx))).shape[:2]
        crop = random_resized_crop_params(sample_rng(3, 0, idx), height, width)
        if roi_scale(crop, 64, ROI_HEADROOM[INTERPOLATIONS[0]]) == 8:
            assert difference == 0, f"sample {idx}: unscaled, so exactly the full decode's pixels"
        else:  # proves the service took the region path: a full decode would be equal here too
            assert 0 < difference < 10, f"sample {idx}: scaled"  # a shifted crop differs by far more
            scaled.append(difference)
    assert len(scaled) >= 5, "too few scaled crops to show the region path ran; change the seed"
    assert np.mean(scaled) < 5


def reference_eval(path: Path, size: int) -> np.ndarray:
    """Independent reference: decode, resize the shorter side (area), center crop, RGB, CHW."""
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    new_h, new_w, crop = eval_geometry(bgr.shape[0], bgr.shape[1], size)
    resized = cv2.resize(bgr, (new_w, new_h), interpolation=cv2.INTER_AREA)
    rgb = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)[crop.top : crop.top + size, crop.left : crop.left + size]
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def test_eval_pixels_match_reference_decode(photos: Path, start_service: ServiceFactory) -> None:
    index = build_index(photos)
    # A full decode: the reference is one; eval's region path is pinned against it in unit tests.
    service = start_service(photos, augment="eval", image_size=48, interpolation="area", decoder="opencv")
    checked = 0
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        for batch in loader:
            for row, idx in enumerate(batch.indices.tolist()):
                expected = reference_eval(photos / index.relpath(idx), 48)
                np.testing.assert_array_equal(batch.images[row].numpy(), expected)
                checked += 1
    assert checked == len(index)


def test_held_batches_stay_intact_while_slots_are_reused(photos: Path, start_service: ServiceFactory) -> None:
    # 6 slots (5 credits: NOTE [ Credits per session ]), 12 batches an epoch: without lease
    # tracking the held batches would be overwritten.
    service = start_service(photos, slots=6, workers=2)
    with ServiceLoader(service.endpoint, credits=5, timeout=30) as loader:
        held, copies = [], []
        for batch in loader:
            if len(held) < 3:
                held.append(batch.images)
                copies.append(batch.images.clone())
        del batch  # the loop variable would pin a fourth slot
        for _ in range(2):
            for _batch in loader:
                pass
        for images, copy in zip(held, copies, strict=True):
            assert torch.equal(images, copy)


def test_writing_into_a_delivered_batch_works(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        for batch in loader:
            batch.images[0].fill_(7)
            batch.images.add_(1)
            assert int(batch.images[0].min()) == 8
            (batch.images.float() / 255).mean()  # and the trainer's usual read still works


def test_holding_every_credit_is_a_clear_error_not_a_hang(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, slots=10)
    with ServiceLoader(service.endpoint, credits=3, timeout=60) as loader:
        it = iter(loader)
        held = [next(it), next(it), next(it)]
        with pytest.raises(ServiceError, match="references all 3 batches"):
            next(it)
        held.pop()
        assert next(iter(loader)).images.shape[0] > 0, "dropping a batch returns its credit"


def test_loader_started_before_service_waits_for_it(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/late.sock"
    attached = threading.Event()

    def trainer() -> int:
        with ServiceLoader(endpoint, connect_timeout=30, timeout=30) as loader:
            attached.set()
            return sum(1 for _ in loader)

    with in_background(trainer, "the trainer") as outcome:
        assert not attached.wait(0.5), "attached with no service running"
        start_service(photos, name="late")
        batches = outcome.result(60)
    assert batches == -(-len(build_index(photos)) // 8)


def test_connect_timeout_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServiceTimeout, match="no loader service answered"):
        ServiceLoader(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.5)


def test_unknown_feed_is_refused(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos)
    with pytest.raises(ServiceError, match=r"serves feed\(s\) 'train', not 'val'"):
        ServiceLoader(service.endpoint, feed="val", connect_timeout=10)


def test_breaking_out_of_an_epoch_then_continuing(photos: Path, start_service: ServiceFactory) -> None:
    index = build_index(photos)
    service = start_service(photos)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        for i, _batch in enumerate(loader):
            if i == 2:
                break
        loader.set_epoch(5)
        epochs, seen = set(), []
        for b in loader:
            epochs.add(b.epoch)
            seen += b.indices.tolist()
        assert epochs == {5}
        assert sorted(seen) == list(range(len(index)))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_exits_zero_and_removes_shared_memory(
    photos: Path, start_service: ServiceFactory, sig: int
) -> None:
    service = start_service(photos)
    segment = service.wait_for(r"\((dataferry-[^)]+)\)").group(1)
    assert segment in our_segments()
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        next(iter(loader))
        assert service.stop(sig) == 0
    assert segment not in our_segments()
    assert "stopped cleanly" in service.log


def test_first_batches_come_from_the_warm_start_and_match_a_cold_start(
    photos: Path, start_service: ServiceFactory
) -> None:
    service = start_service(photos, log_level="DEBUG")
    service.wait_for(r"warm start: batch 1 of epoch 0 of feed 'train' ready \(warm\)")
    warm_before = status(service.endpoint)["feeds"][0]["warm_decoded"]
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        warm = [(b.indices.tolist(), b.images.clone()) for _, b in zip(range(3), loader, strict=False)]
    body = status(service.endpoint)["feeds"][0]
    assert body["warm_decoded"] >= warm_before
    # remainder="drop" is the same plan for one trainer but never served early: a cold start
    with ServiceLoader(service.endpoint, remainder="drop", timeout=30) as loader:
        cold = [(b.indices.tolist(), b.images.clone()) for _, b in zip(range(3), loader, strict=False)]
    for (wi, wp), (ci, cp) in zip(warm, cold, strict=True):
        assert wi == ci and torch.equal(wp, cp), "a warm batch is the batch a cold start decodes"
    service.wait_for(r"took 2 batches of epoch 0 decoded early \(warm\)")


def test_next_epoch_starts_from_batches_decoded_ahead(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, log_level="DEBUG")
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        for _batch in loader:
            pass
        del _batch
        # the step a real trainer would run here leaves the service time to decode ahead
        service.wait_for(r"warm start: batch 0 of epoch 1 of feed 'train' ready \(ahead\)")
        ahead = [(b.indices.tolist(), b.images.clone()) for _, b in zip(range(3), loader, strict=False)]
    service.wait_for(r"took [1-9]\d* batches of epoch 1 decoded early \(ahead\)")
    with ServiceLoader(service.endpoint, remainder="drop", timeout=30) as loader:  # same plan, cold
        loader.set_epoch(1)
        cold = [(b.indices.tolist(), b.images.clone()) for _, b in zip(range(3), loader, strict=False)]
    for (ai, ap), (ci, cp) in zip(ahead, cold, strict=True):
        assert ai == ci and torch.equal(ap, cp), "a batch decoded ahead is the batch a cold start decodes"


def test_an_older_pass_resumed_after_a_newer_one_began_says_so(
    photos: Path, start_service: ServiceFactory
) -> None:
    """Reading on would hand it the newer pass's batches: it ends with an error instead."""
    service = start_service(photos)
    with ServiceLoader(service.endpoint, timeout=30) as loader:
        older = iter(loader)
        next(older)
        newer = iter(loader)
        first = next(newer)
        assert first.epoch == 1 and first.seq == 0
        with pytest.raises(ServiceError, match="a newer iter"):
            next(older)
        assert next(newer).seq == 1, "the newer pass goes on"


def test_an_automatic_pool_grows_to_what_its_trainer_holds(
    photos: Path, start_service: ServiceFactory
) -> None:
    # NOTE [ A pool as large as what is in flight ]: 8 slots reserved at start, 256 at most.
    service = start_service(photos, workers=2)
    stride = slot_reserve(8, 32)  # what each slot reserves: its encoded rows' room only when used
    feed = status(service.endpoint)["feeds"][0]
    assert (sum(feed["slots"].values()), feed["slots_most"]) == (FIRST_SLOTS, AUTO_MOST_SLOTS)
    assert pool_bytes(service.proc.pid) == FIRST_SLOTS * stride + PAGE, "more than the first slots reserved"
    with ServiceLoader(service.endpoint, credits=11, timeout=30) as loader:
        it = iter(loader)
        held = [next(it) for _ in range(10)]  # ten slots held: more than the pool had
        grown = sum(status(service.endpoint)["feeds"][0]["slots"].values())
        assert 10 <= grown <= 11 + 2, "what it holds, its credits at most, and the warm start's"
        assert pool_bytes(service.proc.pid) == grown * stride + PAGE
        assert all(int(b.images.float().std()) > 0 for b in held), "the added slots hold decoded images"
        del held
        for _batch in it:  # the epoch finishes in the slots there are
            pass
    body = status(service.endpoint)  # given back only once mostly free for twice the client timeout
    assert sum(body["feeds"][0]["slots"].values()) == grown, "not given back at once"


def test_a_given_pool_is_reserved_whole_at_start(photos: Path, start_service: ServiceFactory) -> None:
    service = start_service(photos, slots=20)
    assert pool_bytes(service.proc.pid) == 20 * slot_reserve(8, 32) + PAGE
    feed = status(service.endpoint)["feeds"][0]
    assert (sum(feed["slots"].values()), feed["slots_most"]) == (20, 20)
