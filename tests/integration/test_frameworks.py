"""Checkpoints through the training frameworks users run, under real DDP (torchrun, gloo, 2 ranks).

Accelerate and Lightning save the main process's copy of a loader's state and load it on every
rank; a ServiceLoader state names the job's progress, not a rank (NOTE [ Elastic epochs ] in
protocol/shares.py), so each rank resumes its own share from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loader_service.dataset.index import build_index
from tests.helpers import REPO, ServiceFactory, free_port

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


ELASTIC_SCRIPT = """
import glob, json, os, sys, time
import torch
import torch.distributed as dist
from gpu_worker import ServiceLoader

endpoint, ckpt, out = sys.argv[1:4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if world == 1 and not glob.glob(f"{out}.kill-me.*"):
    # The second node has not joined yet (its agent's start outlasted last_call_timeout): this run
    # trains nothing, and its agent restarts it with two ranks once the second node waits.
    time.sleep(120)
    sys.exit("the second node never joined")
with ServiceLoader(endpoint, timeout=60) as loader:  # rank and world size from torchrun
    if os.path.exists(ckpt):
        loader.load_state_dict(json.load(open(ckpt)))
    log = open(f"{out}.{restart}.{rank}", "a")
    for step, batch in enumerate(loader):
        dist.barrier()  # every rank holds its batch: one step of the job
        log.write(json.dumps({"step": step, "world": world, "indices": batch.indices.tolist()}) + "\\n")
        log.flush()
        dist.barrier()  # every rank has trained on it: the step is done
        if rank == 0:  # the job's checkpoint, and which step of which run it covers
            with open(ckpt + ".tmp", "w") as f:
                json.dump(loader.state_dict(), f)
            os.replace(ckpt + ".tmp", ckpt)
            with open(out + ".checkpoints", "a") as f:
                f.write(json.dumps({"restart": restart, "steps": step + 1}) + "\\n")
        if world == 2 and step == 4:
            with open(f"{out}.kill-me.tmp{rank}", "w") as f:  # the test kills one agent now, and
                f.write(str(restart))  # reads this agent's restart count once the file is whole
            os.replace(f"{out}.kill-me.tmp{rank}", f"{out}.kill-me.{os.getppid()}")
            dist.recv(torch.zeros(1), src=1 - rank)  # never sent: ends when the other node is lost
"""


def elastic_agent(script: Path, port: int, *args: str) -> subprocess.Popen[str]:
    """One torchrun agent of a job of 1 to 2 nodes on a c10d rendezvous, in a process group of its
    own (so the test can kill it whole, as a node that is lost)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
        "--rdzv-conf", "last_call_timeout=5,join_timeout=60", "--max-restarts", "3",
        "--monitor-interval", "0.5", str(script), *args,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        # A node joining in a later round than the first (its agent started after the first round
        # closed) waits for MASTER_ADDR forever when rank 0 shares its rendezvous store: rank 0
        # publishes it only in its own first round (torch 2.13's DynamicRendezvousHandler). The
        # opt-out publishes it every round.
        env={
            **os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        },
    )  # fmt: skip


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc: torchrun starts its workers in sessions of their own."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [p for child in map(int, children) for p in (child, *descendants(child))]


def lose_node(agent: subprocess.Popen[str]) -> None:
    """A node lost at once: its agent and its workers, SIGKILLed together."""
    for pid in (*descendants(agent.pid), agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until_listening(port: int, agent: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert agent.poll() is None, "the first agent ended before its rendezvous listened"
        assert time.monotonic() < deadline, f"nothing listened on {port} within {timeout:.0f} s"
        time.sleep(0.1)  # polling a port another process opens


def counted_steps(out: Path) -> list[int]:
    """Every sample of the steps a checkpoint covered: a run's steps after its last checkpoint are
    done again by the next run, as a training job redoes them."""
    covered: dict[int, int] = {}
    for line in Path(f"{out}.checkpoints").read_text().splitlines():
        record = json.loads(line)
        covered[record["restart"]] = max(covered.get(record["restart"], 0), record["steps"])
    seen: list[int] = []
    for log in out.parent.glob(f"{out.name}.[0-9]*.[0-9]*"):  # seen.RESTART.RANK
        restart = int(log.name.split(".")[-2])
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record["step"] < covered.get(restart, 0):
                seen += record["indices"]
    return seen


def test_torchelastic_restarts_at_a_smaller_world_size_and_sees_every_image_once(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    """Two torchrun agents (``--nnodes 1:2``, c10d rendezvous) train one job; after 5 steps one agent
    is killed (SIGKILL to its process group, as a lost node). The other restarts the job with one
    rank from the last checkpoint, which rank 0 of two wrote: every image of the epoch once."""
    n = len(build_index(photos))
    service = start_service(photos, batch_size=2)
    script = tmp_path / "train.py"
    script.write_text(ELASTIC_SCRIPT)
    ckpt, out = tmp_path / "ckpt.json", tmp_path / "seen"
    port = free_port()
    first = elastic_agent(script, port, service.endpoint, str(ckpt), str(out))
    second: subprocess.Popen[str] | None = None
    try:
        wait_until_listening(port, first)  # the first agent hosts the rendezvous: it must not be lost
        second = elastic_agent(script, port, service.endpoint, str(ckpt), str(out))
        deadline = time.monotonic() + 120
        marks = [Path(f"{out}.kill-me.{agent.pid}") for agent in (first, second)]
        while not all(mark.exists() for mark in marks):  # both ranks at their fifth step
            for agent in (first, second):
                if agent.poll() is not None:
                    pytest.fail(f"an agent ended before the kill:\n{agent.communicate()[0][-3000:]}")
            assert time.monotonic() < deadline, "the job never reached its fifth step"
            time.sleep(0.1)  # polling a file another process writes
        killed_in = int(marks[0].read_text())  # the surviving agent's restart count at the kill
        lose_node(second)
        output, _ = first.communicate(timeout=180)
        assert first.returncode == 0, output[-4000:]
    finally:
        for agent in (first, second):
            if agent is not None:
                lose_node(agent)
                agent.communicate(timeout=10)  # reaps it and closes its pipe

    def worlds(restarts: Callable[[int], bool]) -> set[int]:
        logs = [log for log in tmp_path.glob("seen.[0-9]*.[0-9]*") if restarts(int(log.name.split(".")[1]))]
        return {json.loads(line)["world"] for log in logs for line in log.read_text().splitlines()}

    assert worlds(lambda restart: restart == killed_in) == {2}, "the job trained with two ranks"
    assert worlds(lambda restart: restart > killed_in) == {1}, "the restarted job had one rank"
    assert sorted(counted_steps(out)) == list(range(n)), "every image exactly once across both runs"
