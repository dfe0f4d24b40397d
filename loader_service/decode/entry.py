"""A decode worker's entry point, as the service hands it to the process that starts workers: it
imports the decoder in the worker, never in the service's main process (NOTE [ The worker
contract ]), and nothing else the worker does not need."""

from __future__ import annotations

from loader_service.decode.contract import WorkerConfig


def worker_main(cfg: WorkerConfig) -> None:
    from loader_service.decode.worker import run_worker

    run_worker(cfg)
