"""Checkpoints through the training frameworks users run, under real DDP (torchrun, gloo, 2 ranks).

Accelerate and Lightning save the main process's copy of a loader's state and load it on every
rank; a ServiceLoader state names the job's progress, not a rank (NOTE [ Elastic epochs ] in
protocol/shares.py), so each rank resumes its own share from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader_service.dataset.index import build_index
from tests.helpers import REPO, ServiceFactory

pytestmark = pytest.mark.integration

ACCELERATE_SCRIPT = """
import json, sys
import torch
from accelerate import Accelerator
from gpu_worker import ServiceLoader

endpoint, ckpt, out, phase = sys.argv[1:5]
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(3, 1)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
with ServiceLoader(endpoint, timeout=60) as loader:  # rank and world size from torchrun
    accelerator.register_for_checkpointing(loader)
    if phase == "resume":
        accelerator.load_state(ckpt)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch.indices.tolist()
        loss = model(batch.images.float().mean(dim=(2, 3))).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if phase == "first" and step == 2:
            accelerator.save_state(ckpt)
            break
    json.dump(seen, open(f"{out}.{accelerator.process_index}", "w"))
    accelerator.wait_for_everyone()
"""


def torchrun(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), *args],
        check=False, capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_accelerate_save_state_and_load_state_under_ddp_resume_exactly_once(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    """``register_for_checkpointing(loader)``, ``save_state`` after 3 steps, then a new job's
    ``load_state``: rank 1 takes the main process's state (before, it refused it: "rank: state has
    0, this loader 1"), and the two runs of both ranks see every image once."""
    pytest.importorskip("accelerate")
    n = len(build_index(photos))
    service = start_service(photos, batch_size=4)
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT)
    ckpt, out = tmp_path / "ckpt", tmp_path / "seen"
    seen: list[int] = []
    for phase in ("first", "resume"):
        run = torchrun(script, service.endpoint, str(ckpt), f"{out}-{phase}", phase)
        assert run.returncode == 0, run.stderr[-3000:]
        for rank in range(2):
            seen += json.loads(Path(f"{out}-{phase}.{rank}").read_text())
    assert sorted(seen) == list(range(n)), "every image exactly once across both jobs and ranks"
