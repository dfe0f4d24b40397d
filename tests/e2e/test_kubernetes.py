"""deploy/kubernetes/: the manifests are valid Kubernetes objects, and their numbers agree.

Validated offline against the Kubernetes schemas (``kubernetes-validate``, strict: an unknown field
is an error, as a typo in a manifest would be). No cluster runs here, so what the files promise to
each other is checked instead: CPU for the workers, /dev/shm for the pool, and the endpoints the
trainer Job names for the loaders the StatefulSet runs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from loader_service.config.options import ServiceConfig
from protocol import status
from tests.helpers import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

FOLDER = REPO / "deploy" / "kubernetes"
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def objects(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((FOLDER / name).read_text()) if doc]


MANIFESTS = ("loader-fleet.yaml", "trainer-job.yaml", "autoscaling.yaml")


def by_kind(kind: str) -> dict[str, Any]:
    found = [o for name in MANIFESTS for o in objects(name) if o["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def size(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * QUANTITY.get(unit or "", 1)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_is_a_valid_kubernetes_object(name: str) -> None:
    for obj in objects(name):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_loaders_cpu_and_shared_memory_fit_their_flags() -> None:
    pod = by_kind("StatefulSet")["spec"]["template"]["spec"]
    loader = pod["containers"][0]
    served = flags(loader["args"])
    cpu = loader["resources"]
    assert "workers" not in served, "NOTE [ CPU budget ]: the pod's CPU limit sizes the workers"
    assert cpu["limits"]["cpu"] == cpu["requests"]["cpu"], "the budget the scheduler reserved"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
    slot = int(served["batch-size"]) * 3 * int(served["image-size"]) ** 2
    # the pool, and as much again for copies on their way to remote trainers
    assert shm["medium"] == "Memory" and size(shm["sizeLimit"]) >= 2 * int(served["slots"]) * slot
    mounts = {m["mountPath"]: m["name"] for m in loader["volumeMounts"]}
    assert mounts["/dev/shm"] == "shm"
    probe = loader["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["loader-service", "status"] and "--endpoint=tcp://127.0.0.1:5555" in probe


def test_the_trainer_job_names_the_fleets_headless_service() -> None:
    """NOTE [ A fleet from a name ]: one name, every ready pod behind it, followed as pods change."""
    fleet, service = by_kind("StatefulSet"), by_kind("Service")
    job = by_kind("Job")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in job["env"]}
    port = service["spec"]["ports"][0]["port"]
    name = fleet["spec"]["serviceName"]
    assert service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    assert not service["spec"]["publishNotReadyAddresses"], "a pod resolves only once it is ready"
    assert env["DATAFERRY_ENDPOINTS"] == f"tcp://{name}:{port}"
    assert env["DATAFERRY_SERVER_KEY"] and env["DATAFERRY_CLIENT_KEY"]


def test_the_autoscaler_scales_the_fleet_on_the_load_the_pods_export() -> None:
    """NOTE [ Fleet load ]: the metric the HorizontalPodAutoscaler asks for is the one the adapter's
    rule serves, which is the one the service exports, on the port Prometheus is told to scrape."""
    hpa, fleet = by_kind("HorizontalPodAutoscaler")["spec"], by_kind("StatefulSet")
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", fleet["metadata"]["name"])
    assert "replicas" not in fleet["spec"], "kubectl apply would undo what the autoscaler chose"
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    target_value = metric["pods"]["target"]["averageValue"]
    assert target_value.endswith("m") and 0 < int(target_value[:-1]) < 1000, "spare capacity kept"
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]

    (rule,) = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert name in {metric.name for _, metric in status.metrics()}, "NOTE [ Status contract ]"

    pod = fleet["spec"]["template"]
    loader = pod["spec"]["containers"][0]
    served = flags(loader["args"])
    ports = {p["name"]: p["containerPort"] for p in loader["ports"]}
    assert served["metrics-addr"] == "$(POD_IP)", "scraped from outside the pod, on its own address"
    scraped = int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert int(served["metrics-port"]) == ports["metrics"] == scraped


def test_only_prometheus_reaches_the_metrics_port() -> None:
    """/metrics has no authentication: the pods serve it on their own IP (the service's default is
    loopback), and a NetworkPolicy lets in only Prometheus's pods there, while the feed port stays
    open to any pod (CURVE admits only the trainers' keys). Before, 0.0.0.0 and no policy."""
    fleet, policy = by_kind("StatefulSet"), by_kind("NetworkPolicy")["spec"]
    loader = fleet["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in loader["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert policy["podSelector"]["matchLabels"] == fleet["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"], "what is not listed below is refused"
    opened = {port["port"]: rule.get("from") for rule in policy["ingress"] for port in rule["ports"]}
    assert set(opened) == {p["name"] for p in loader["ports"]} == {"feed", "metrics"}
    assert opened["feed"] is None, "any pod may reach the feed port: CURVE decides who is let in"
    (prometheus,) = opened["metrics"]
    assert set(prometheus) == {"namespaceSelector", "podSelector"}, "one entry: that namespace AND those pods"
    default = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}["metrics_addr"]
    assert default == "127.0.0.1", "loopback unless the operator says otherwise"


def test_the_image_holds_the_service_and_its_extras_and_nothing_to_build_or_test_with() -> None:
    """Two stages: wheels built where a compiler is; the image installs them alone. Before, it ran
    scripts/setup: gcc, pytest, mypy, mkdocs, SeaweedFS and torch shipped to production."""
    dockerfile = (FOLDER / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)[1:]
    assert len(stages) == 2 and stages[0].split()[2] == "build"
    build, image = stages
    assert (
        "gcc" in build and 'pip wheel --no-cache-dir --wheel-dir /wheels ".[cloud,parquet,metrics]"' in build
    )
    assert "--no-index --find-links /wheels" in image and '"dataferry[cloud,parquet,metrics]"' in image
    for word in ("gcc", "-dev", "scripts/setup", "torch", "dev]", "docs]"):
        assert word not in image, f"the image stage holds {word}"
    assert "/opt/dataferry/.venv/bin" in image


def mounted_keys(pod: dict[str, Any], path: str) -> set[str]:
    """The files a pod's container sees under ``path``: (Secret, key) pairs, from a secret volume
    (every key) or a projected one (its items)."""
    container = pod["containers"][0]
    name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in pod["volumes"] if v["name"] == name)
    if "secret" in volume:
        return {f"{volume['secret']['secretName']}:*"}
    return {
        f"{source['secret']['name']}:{item['key']}"
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }


def test_each_side_holds_only_its_own_secret_key() -> None:
    """The loaders' Secret is not the trainers': a loader pod never holds a trainer's secret key, a
    trainer pod never the service's; the loaders let in the trainer's public key and the one their
    own readiness probe connects with."""
    loader_pod = by_kind("StatefulSet")["spec"]["template"]["spec"]
    trainer_pod = by_kind("Job")["spec"]["template"]["spec"]
    assert mounted_keys(loader_pod, "/keys") == {"dataferry-service:*"}
    assert mounted_keys(trainer_pod, "/keys") == {"dataferry-trainer:*"}
    allowed = mounted_keys(loader_pod, "/trainers")
    assert allowed == {"dataferry-trainer:trainer.key", "dataferry-service:service.key"}
    assert not any(key.endswith("_secret") for key in allowed)
    probe = flags(loader_pod["containers"][0]["readinessProbe"]["exec"]["command"])
    assert probe["client-key"] == "/keys/service.key_secret", "the probe uses the pod's own key pair"
    env = {e["name"]: e.get("value") for e in trainer_pod["containers"][0]["env"]}
    assert env["DATAFERRY_CLIENT_KEY"] == "/keys/trainer.key_secret"


def test_the_image_copies_what_the_install_needs_and_no_secret() -> None:
    """``COPY . .`` with no .dockerignore baked a ``keys/`` folder into the image: the Dockerfile
    names what it copies, and the build context leaves key files and venvs out besides."""
    dockerfile = (FOLDER / "Dockerfile").read_text()
    sources = [
        line.split()[1:-1]
        for line in dockerfile.splitlines()
        if line.startswith("COPY ") and not line.startswith("COPY --from=")
    ]
    copied = {source.rstrip("/") for group in sources for source in group}
    assert "." not in copied
    assert copied == {
        "pyproject.toml",
        "README.md",
        "protocol",
        "loader_service",
        "gpu_worker",
    }
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"**/*.key_secret", "**/keys/", ".venv/", ".git/"} <= set(ignored)
