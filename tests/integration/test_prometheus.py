"""Debian's real Prometheus server scrapes a real service with two trainers attached, evaluating
``deploy/prometheus/dataferry-rules.yml``; every query of the Grafana dashboard
(``deploy/grafana/dataferry-dashboard.json``) and every rule is then run against it and must return
data (issue 39).

The feed mixes three sources and each trainer is a weighted job of its own process, so the
per-source ledger has data: one trainer only pulls (input-bound: DataferryInputBound must go
pending), the other computes 0.2 s a step (fed). An alert whose condition does not hold here is
checked through the expression under its threshold (``UNDER_THRESHOLD``).

With ``DATAFERRY_DASHBOARD_PNG=docs/images/dashboard-panels.png`` the run goes on for
``DATAFERRY_DASHBOARD_SECONDS`` (default 360), the fed trainer changes its weights a third of the
way into the picture, and ``deploy/grafana/render_panels.py`` draws the operations page's picture
from this Prometheus's data (matplotlib: the ``bench`` extra), from the 2nd minute on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.helpers import REPO, ServiceFactory, free_port

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")
RULES = REPO / "deploy" / "prometheus" / "dataferry-rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dataferry-dashboard.json"
RENDER = REPO / "deploy" / "grafana" / "render_panels.py"

NAMES = ("folder", "shards", "list")
KINDS = ("imagefolder", "tar", "csv")
EPOCH = 200
HUNGRY = {"folder": 0.2, "shards": 0.5, "list": 0.3}
FED = {"folder": 0.6, "shards": 0.1, "list": 0.3}
FED_LATER = {"folder": 0.1, "shards": 0.6, "list": 0.3}
FED_STEP = 0.2
"""Seconds the fed trainer's step takes: far longer than the service needs for a batch."""

UNDER_THRESHOLD = {
    "DataferryInputBound": ["client:dataferry_trainer_wait_share:max"],
    "DataferryAtCpuBudget": [
        "dataferry_load",
        "dataferry_demand",
        "dataferry_decode_workers_active - floor(dataferry_cpu_budget_cores)",
    ],
    "DataferryWorkersRestarting": ["instance:dataferry_worker_restarts:increase15m"],
    "DataferryBadFiles": ["feed:dataferry_bad_files:ratio_rate2m"],
    "DataferryStoreNotAnswering": ["feed:dataferry_store_waits:increase10m"],
    "DataferrySharedMemoryNearlyFull": ["instance:dataferry_shm_free_bytes:ratio"],
}
"""Per alert, what its condition compares, without the threshold: these return data whether or not
the alert's condition holds in this run."""
HOLDS_HERE = {"DataferryInputBound"}
"""Alerts whose condition holds in this run (the hungry trainer): their expression returns data and
they go pending. DataferryAtCpuBudget may hold too: a trainer that only pulls asks for more than any
CPU budget gives (on a 2-core host it does, its 2 workers at the budget's 2 cores)."""
HEALTHY_HERE = {"DataferryWorkersRestarting", "DataferryBadFiles", "DataferryStoreNotAnswering"}
"""Alerts that must stay quiet: no worker dies, no file is bad and no store is silent here."""

PICTURE = os.environ.get("DATAFERRY_DASHBOARD_PNG", "")
"""Where to draw the operations page's picture (relative to the checkout); empty: no picture."""
PICTURE_SECONDS = float(os.environ.get("DATAFERRY_DASHBOARD_SECONDS", "360")) if PICTURE else 0.0
PICTURE_FROM = 120.0
"""Seconds into the run the picture starts: the rules' rates over 2 minutes are whole from there."""
PICTURED = (
    "Trainer wait share",
    "Trainer data stall per step",
    "Images decoded per second",
    "Load, busy and demand",
    "Each trainer's share by source: realized and asked",
    "Feed's rows by source",
)
"""The panels the operations page shows."""

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus package is not installed (scripts/setup installs it as root where "
    "apt-get is; or: apt-get install prometheus)",
)


# --- the trainers: one process each, so each is a client of its own --------------------------------


def train() -> None:
    """A trainer process (``python -c``; arguments in ``sys.argv``): a weighted job pulling epoch after
    epoch until SIGTERM, its step ``step`` seconds, changing to ``later`` weights after
    ``switch_after`` seconds, with the data stall per step served on ``metrics_port``."""
    from gpu_worker import ServiceLoader
    from gpu_worker.metrics import TrainerMetrics

    endpoint, weights, later, step, metrics_port, switch_after = sys.argv[1:7]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    metrics = TrainerMetrics()
    metrics.start(int(metrics_port))
    began, switched = time.monotonic(), False
    try:
        with ServiceLoader(endpoint, weights=json.loads(weights), epoch_samples=EPOCH, timeout=60) as loader:
            epoch = 0
            while not stop.is_set():
                loader.set_epoch(epoch)
                batches = iter(loader)
                for k in range(len(loader)):
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        break
                    metrics.observe(time.perf_counter() - t0, loader.last_endpoint)
                    del batch
                    time.sleep(float(step))  # the training step
                    if stop.is_set():
                        break
                    due = time.monotonic() - began > float(switch_after)
                    if not switched and due and k + 1 < len(loader):
                        loader.set_weights(json.loads(later), at_batch=k + 1)
                        switched = True
                epoch += 1
    finally:
        metrics.stop()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it is still there 20 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def trainer(
    endpoint: str, weights: dict[str, float], step: float, log: Path, switch: tuple[dict[str, float], float]
) -> Iterator[int]:
    """A ``train`` process; yields the port its metrics are on. Stopped (SIGTERM, then SIGKILL)."""
    port = free_port()
    later, after = switch
    args = [endpoint, json.dumps(weights), json.dumps(later), str(step), str(port), str(after)]
    code = "from tests.integration.test_prometheus import train; train()"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield port
    finally:
        stop(proc)
        print(f"--- trainer {log.stem} (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


# --- Prometheus -------------------------------------------------------------------------------------


def api(url: str, path: str, **params: str) -> Any:
    """``GET url/api/v1/path?params``'s ``data``; AssertionError with Prometheus's word if refused."""
    query = urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"Prometheus refused {path} {params}: {exc.read().decode()}") from None
    assert body["status"] == "success", body
    return body["data"]


@contextlib.contextmanager
def prometheus(folder: Path, targets: dict[str, list[str]]) -> Iterator[str]:
    """Prometheus scraping ``targets`` (job -> host:port) every second and evaluating the repo's rules
    every second, its data in ``folder``; yields its URL once it is ready. Stopped at the end."""
    assert PROMETHEUS is not None
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]} for job, hosts in targets.items()
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        poll(ready, "Prometheus ready", 60)
        yield url
    finally:
        stop(proc)
        print(f"--- prometheus log:\n{log.read_text()[-4000:]}")


def poll(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """Ask until ``condition``: Prometheus's scrapes and rule evaluations have no event to wait on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}")
        time.sleep(0.5)


def empty(url: str, expr: str) -> bool:
    """Whether ``expr`` returns nothing now (an error fails the test)."""
    return not api(url, "query", query=expr)["result"]


def has_data(url: str, expr: str) -> Callable[[], bool]:
    """A condition for ``poll``: ``expr`` returns something."""
    return lambda: not empty(url, expr)


# --- what the dashboard and the rules ask -----------------------------------------------------------


def dashboard_queries(variables: dict[str, str]) -> dict[str, str]:
    """``panel title / refId`` -> its query with the dashboard's variables filled in."""
    render = render_module()
    board = render.load_dashboard(DASHBOARD)
    return {
        f"{panel['title']} / {target['refId']}": render.fill(target["expr"], variables)
        for panel in render.panels(board)
        for target in panel["targets"]
    }


def variable_selectors(variables: dict[str, str]) -> dict[str, str]:
    """Each query variable's ``label_values(selector, label)`` -> its selector, filled in."""
    render = render_module()
    found = {}
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] == "query":
            inner = var["definition"].removeprefix("label_values(").removesuffix(")")
            selector, label = (part.strip() for part in inner.rsplit(",", 1))
            found[f"${var['name']} ({label})"] = render.fill(selector, variables)
    return found


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_panels", RENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_alert_has_what_it_compares_named() -> None:
    """Pure: the map this test checks alerts by covers exactly the alerts of the rules file."""
    assert {r["alert"] for r in rules() if "alert" in r} == set(UNDER_THRESHOLD)
    assert set(UNDER_THRESHOLD) >= HOLDS_HERE


@needs_prometheus
@pytest.mark.timeout(180 + PICTURE_SECONDS)
def test_every_dashboard_query_and_rule_returns_data_from_a_real_prometheus(
    photo_sources: dict[str, Path], start_service: ServiceFactory, tmp_path: Path
) -> None:
    pytest.importorskip("prometheus_client")
    picture, seconds = PICTURE, PICTURE_SECONDS
    switch = PICTURE_FROM + (seconds - PICTURE_FROM) / 3 if picture else float("inf")
    port = free_port()
    flags = [f"{name}={photo_sources[kind]}" for name, kind in zip(NAMES, KINDS, strict=True)]
    service = start_service(
        None,
        source=flags,
        workers="auto",
        batch_size=8,
        cache_memory="64M",
        metrics_port=port,
        heartbeat_interval=0.25,
    )
    never = (HUNGRY, float("inf"))
    with (
        trainer(service.endpoint, HUNGRY, 0.0, tmp_path / "hungry.log", never) as hungry,
        trainer(service.endpoint, FED, FED_STEP, tmp_path / "fed.log", (FED_LATER, switch)) as fed,
        prometheus(
            tmp_path,
            {"loader": [f"127.0.0.1:{port}"], "trainer": [f"127.0.0.1:{hungry}", f"127.0.0.1:{fed}"]},
        ) as url,
    ):
        began = time.time()
        variables = {"job": "loader", "instance": f"127.0.0.1:{port}", "__rate_interval": "1m"}
        queries = {
            **dashboard_queries(variables),
            **{f"rule {r['record']}": r["expr"] for r in rules() if "record" in r},
            **{f"stored {r['record']}": r["record"] for r in rules() if "record" in r},
            **{f"{a} under its threshold: {q}": q for a, qs in UNDER_THRESHOLD.items() for q in qs},
            **{f"{a} holds here": r["expr"] for r in rules() if (a := r.get("alert")) in HOLDS_HERE},
        }

        def up() -> bool:
            active = api(url, "targets")["activeTargets"]
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        poll(up, "the service and both trainers scraped", 60)
        still: list[str] = []

        def answered() -> bool:
            still[:] = [name for name, q in queries.items() if empty(url, q)]
            return not still

        with contextlib.suppress(AssertionError):
            poll(answered, "every query to return data", 90)
        assert not still, "no data from:\n" + "\n".join(f"  {n}: {queries[n]}" for n in still)
        for name, selector in variable_selectors(variables).items():
            assert api(url, "series", **{"match[]": selector}), f"dashboard variable {name}: no series"
        for alert in HOLDS_HERE:
            pending = f'ALERTS{{alertname="{alert}", alertstate="pending", client!=""}}'
            poll(has_data(url, pending), f"{alert} pending for the hungry trainer", 60)
        for group in api(url, "rules")["groups"]:
            for rule in group["rules"]:
                assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        for alert in HEALTHY_HERE:  # no false alarm from a healthy service reading good files
            assert empty(url, f'ALERTS{{alertname="{alert}"}}'), f"{alert} went off"
        fed_share = "client:dataferry_trainer_wait_share:max <= 0.2"
        poll(has_data(url, fed_share), "the fed trainer not input-bound", 60)
        assert up(), "the service and both trainers still run"
        if picture:  # after the rules' 2-minute windows have filled, until the end

            def recorded() -> bool:
                assert up(), "the service or a trainer went down: no picture of that"
                return time.time() >= began + seconds

            poll(recorded, f"{seconds:.0f} s of data for the picture", seconds + 60)
            shown = began + PICTURE_FROM
            drawn = render_module().render(url, REPO / picture, shown, time.time(), PICTURED, variables)
            assert drawn == list(PICTURED)
