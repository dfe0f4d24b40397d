"""NOTE [ Per-sample progress ]: the page workers write and the service reads."""

from __future__ import annotations

from pathlib import Path

from gpu_worker.loader_config import LoaderConfig
from loader_service.config.options import ServiceConfig
from loader_service.decode.progress import PREFETCHING, ProgressBoard
from loader_service.supervisor.service import HOUSEKEEPING


def test_what_one_process_writes_another_mapping_reads(tmp_path: Path) -> None:
    service = ProgressBoard(tmp_path / "progress", 3, create=True)
    worker = ProgressBoard(tmp_path / "progress", 3)
    try:
        assert service.read(1) == (-1, 0), "no task yet"
        worker.start(1, 42)
        worker.finished(1, 5)
        assert service.read(1) == (42, 5) and service.read(0) == (-1, 0)
        assert service.read(7) == (-1, 0), "a worker number it has no room for reads as nothing"
        worker.start(2, 43, PREFETCHING)
        assert service.read(2) == (43, PREFETCHING)
        for _ in range(3):
            worker.answered(2)
        assert (service.answers(2), service.answers(1), service.answers(7)) == (3, 0, 0)
    finally:
        worker.close()
        service.close()


def test_one_hanging_sample_costs_less_than_a_default_trainers_patience() -> None:
    """A hang is found after one task timeout (a time per sample) and the batch is redone without the
    sample: with the defaults, a trainer waiting for that batch must not time out first."""
    task_timeout = ServiceConfig.__dataclass_fields__["task_timeout"].default
    assert isinstance(task_timeout, float)
    assert task_timeout + HOUSEKEEPING < LoaderConfig.timeout / 2
