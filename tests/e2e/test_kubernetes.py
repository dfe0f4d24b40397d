"""deploy/kubernetes/: the manifests are valid Kubernetes objects, and their numbers agree.

Validated offline against the Kubernetes schemas (``kubernetes-validate``, strict: an unknown field
is an error, as a typo in a manifest would be). No cluster runs here, so what the files promise to
each other is checked instead: CPU for the workers, /dev/shm for the pool, and the endpoints the
trainer Job names for the loaders the StatefulSet runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

FOLDER = REPO / "deploy" / "kubernetes"
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def objects(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((FOLDER / name).read_text()) if doc]


def by_kind(kind: str) -> dict[str, Any]:
    found = [
        o for name in ("loader-fleet.yaml", "trainer-job.yaml") for o in objects(name) if o["kind"] == kind
    ]
    assert len(found) == 1, kind
    return found[0]


def flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def size(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * QUANTITY.get(unit or "", 1)


@pytest.mark.parametrize("name", ["loader-fleet.yaml", "trainer-job.yaml"])
def test_every_manifest_is_a_valid_kubernetes_object(name: str) -> None:
    for obj in objects(name):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_loaders_cpu_and_shared_memory_fit_their_flags() -> None:
    pod = by_kind("StatefulSet")["spec"]["template"]["spec"]
    loader = pod["containers"][0]
    served = flags(loader["args"])
    assert int(loader["resources"]["requests"]["cpu"]) == int(served["workers"]) + 1, "a core per worker"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
    slot = int(served["batch-size"]) * 3 * int(served["image-size"]) ** 2
    # the pool, and as much again for copies on their way to remote trainers
    assert shm["medium"] == "Memory" and size(shm["sizeLimit"]) >= 2 * int(served["slots"]) * slot
    mounts = {m["mountPath"]: m["name"] for m in loader["volumeMounts"]}
    assert mounts["/dev/shm"] == "shm"
    probe = loader["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["loader-service", "status"] and "--endpoint=tcp://127.0.0.1:5555" in probe


def test_the_trainer_job_names_every_loader_of_the_statefulset() -> None:
    fleet, service = by_kind("StatefulSet"), by_kind("Service")
    job = by_kind("Job")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in job["env"]}
    port = service["spec"]["ports"][0]["port"]
    name = fleet["spec"]["serviceName"]
    assert service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    expected = [
        f"tcp://{fleet['metadata']['name']}-{i}.{name}:{port}" for i in range(fleet["spec"]["replicas"])
    ]
    assert env["DATAFERRY_ENDPOINTS"].split(",") == expected
    assert env["DATAFERRY_SERVER_KEY"] and env["DATAFERRY_CLIENT_KEY"]


def test_the_image_installs_what_scripts_setup_installs() -> None:
    dockerfile = (FOLDER / "Dockerfile").read_text()
    assert re.search(r"^RUN scripts/setup\b", dockerfile, re.MULTILINE)
    assert "/opt/dataferry/.venv/bin" in dockerfile
    assert Path(REPO / "scripts" / "setup").exists()
