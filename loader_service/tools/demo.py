"""``loader-service demo``: the whole path on one machine, for a first look.

Makes (or reuses) a sample dataset, starts ``loader-service serve`` and ``gpu-worker run`` as real
processes, prints what the trainer reports, stops the service with SIGTERM and checks that it left
nothing in /dev/shm. All of it runs in a private folder of its own, whatever folder it was started
from, since the processes it starts look first for imports in theirs
(NOTE [ Nothing from the working folder ]): the package must be installed (``pip install -e .``
in a checkout), as for any console script.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from loader_service.tools.sample_data import make_sample_dataset, progress_printer
from loader_service.working_folder import moved_to
from protocol.layout import SEGMENT_PREFIX

SERVICE_STOP_TIMEOUT = 20.0


def run_demo(args: argparse.Namespace) -> int:
    data = Path(os.path.abspath(args.dir)) / "data"  # named before the demo moves to its own folder
    with tempfile.TemporaryDirectory(prefix="dataferry-demo-") as run_dir, moved_to(run_dir):
        print(f"demo: sample dataset in {data}", flush=True)
        summary = make_sample_dataset(
            data, classes=args.classes, per_class=args.per_class, progress=progress_printer("sample images")
        )
        print(
            f"demo: {summary.images} JPEGs, mean {summary.mean_width:.0f}x{summary.mean_height:.0f}",
            flush=True,
        )
        endpoint = f"ipc://{run_dir}/feed.sock"
        service = _start_service(args, data, endpoint)
        try:
            trainer = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpu_worker",
                    "run",
                    "--endpoint",
                    endpoint,
                    "--epochs",
                    str(args.epochs),
                ],
                check=False,
            )
        finally:
            service_code = _stop(service)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"{SEGMENT_PREFIX}{service.pid}-")]
    print(
        f"demo: trainer exit {trainer.returncode}, service exit {service_code}, "
        f"shared memory left behind: {len(leftovers)} segments",
        flush=True,
    )
    return 0 if trainer.returncode == 0 and service_code == 0 and not leftovers else 1


def _start_service(args: argparse.Namespace, data: Path, endpoint: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "loader_service",
        "serve",
        "--data",
        str(data),
        "--endpoint",
        endpoint,
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
    ]
    print("demo: starting", " ".join(cmd[2:]), flush=True)
    return subprocess.Popen(cmd, start_new_session=True)


def _stop(service: subprocess.Popen[bytes]) -> int:
    if service.poll() is None:
        service.send_signal(signal.SIGTERM)
    try:
        return service.wait(SERVICE_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(service.pid, signal.SIGKILL)
        service.wait()
        return -9
