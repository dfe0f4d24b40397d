"""The Prometheus rules and the Grafana dashboard in ``deploy/`` (issue 39), read as files: promtool
checks the rules and runs their unit tests (``deploy/prometheus/tests/``), and every metric name a
rule or a dashboard query uses is one the service or a trainer exports, or a recording rule
defines. Also the metrics the rules needed: /dev/shm's space and the renamed ratios.

promtool is Debian's ``prometheus`` package (``scripts/setup`` installs it as root where apt-get
is); without it those two tests skip. ``tests/integration/test_prometheus.py`` runs every rule and
query against a real Prometheus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from loader_service.supervisor.edges import metrics as service_metrics
from loader_service.supervisor.edges.status import shm_space
from protocol import status
from tests.helpers import REPO, whole_status

PROMTOOL = shutil.which("promtool")
RULES_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dataferry-dashboard.json"
PROVIDER = REPO / "deploy" / "grafana" / "provisioning" / "dashboards.yml"
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed: Debian's prometheus package (scripts/setup installs it as root "
    "where apt-get is; or: apt-get install prometheus)",
)
ASKED_FOR = {  # issue 39: an alert for each
    "DataferryInputBound",  # a trainer input-bound for 10 minutes
    "DataferryAtCpuBudget",  # a service at its CPU budget
    "DataferryWorkersRestarting",  # workers restarting
    "DataferryStoreNotAnswering",  # store errors: a silent store's tasks handed back
    "DataferryBadFiles",  # and what a store's errors end in (403, 404, a changed object)
    "DataferrySharedMemoryNearlyFull",  # shared memory nearly full
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def rules() -> list[dict[str, Any]]:
    groups = [group for path in rule_files() for group in yaml.safe_load(path.read_text())["groups"]]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", *map(str, rule_files()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_the_rules_pass_their_unit_tests() -> None:
    """Input series for each alert: one that fires at its threshold and duration, ones just short
    of either that do not (deploy/prometheus/tests/)."""
    tests = sorted((RULES_DIR / "tests").glob("*.yml"))
    assert tests
    done = promtool("test", "rules", *map(str, tests))
    assert done.returncode == 0, done.stdout + done.stderr


def test_there_is_an_alert_for_each_case_the_issue_names() -> None:
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(alerts) == ASKED_FOR
    assert alerts["DataferryInputBound"]["for"] == "10m"
    assert "> 0.2" in alerts["DataferryInputBound"]["expr"], "NOTE [ Input-bound verdict ]'s 20 %"
    for alert in alerts.values():
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical")


# --- every name a rule or a panel uses is exported or recorded ------------------------------------

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan",
}  # fmt: skip
DROPPED = [
    re.compile(r'"(?:[^"\\]|\\.)*"'),  # strings: label values, regexes
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\[[^\]]*\]"),  # ranges
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
    re.compile(r"\$\{?\w+\}?"),  # Grafana's variables
    re.compile(r"\b\d+(?:ms|[smhdwy])\b"),  # durations (offset 5m)
    re.compile(r"\b\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\b"),  # numbers
]
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*(?!\s*\()")
FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords and labels left out)."""
    for pattern in DROPPED:
        expr = pattern.sub(" ", expr)
    expr = FUNCTION.sub(" ", expr)
    return {name for name in IDENTIFIER.findall(expr) if name not in PROMQL_WORDS}


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, instance) (rate(dataferry_x_bucket{job=~"$job"}'
        "[$__rate_interval]))) / ignoring (source) group_left sum without (a) (b:c:d offset 5m) > 1e-3"
    )
    assert metric_names(expr) == {"dataferry_x_bucket", "b:c:d"}


def documented_service_metrics() -> dict[str, str]:
    """What the status contract declares (NOTE [ Status contract ]) and the ready-wait histogram:
    the name Prometheus stores (a counter's with ``_total``) -> kind."""
    declared = [metric for _, metric in status.metrics()] + [status.READY_WAIT]
    return {m.name + ("_total" if m.kind == "counter" else ""): m.kind for m in declared}


def exported_names() -> set[str]:
    """What Prometheus stores from the service and a trainer: the documented names, a histogram's
    series, the old names kept one release, and ``gpu-worker run``'s stall histogram."""
    names: set[str] = set(service_metrics.RENAMED.values())
    for name, kind in {**documented_service_metrics(), status.BATCH_WAIT.name: "histogram"}.items():
        names |= {f"{name}_{part}" for part in ("bucket", "sum", "count")} if kind == "histogram" else {name}
    return names


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def dashboard_exprs() -> dict[str, str]:
    board = json.loads(DASHBOARD.read_text())
    exprs: dict[str, str] = {}
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                exprs[f"{inner['title']} / {target['refId']}"] = target["expr"]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            exprs[f"${var['name']}"] = var["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
    return exprs


def test_the_rules_read_only_exported_metrics_and_each_other() -> None:
    known = exported_names() | recorded_names()
    unknown = {r.get("record") or r["alert"]: metric_names(r["expr"]) - known for r in rules()}
    assert not {k: v for k, v in unknown.items() if v}, "names nothing exports or records"


def test_the_dashboard_reads_only_exported_metrics_and_recording_rules() -> None:
    known = exported_names() | recorded_names()
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    unknown = {where: metric_names(expr) - known for where, expr in exprs.items()}
    assert not {k: v for k, v in unknown.items() if v}, "names nothing exports or records"
    used = set().union(*(metric_names(e) for e in exprs.values()))
    ledger = {
        "client_source:dataferry_trainer_source_served_samples:ratio_rate2m",
        "client_source:dataferry_trainer_source_asked_ratio:max",
        "source:dataferry_source_served_samples:ratio_rate2m",
        "dataferry_trainer_source_pass",
    }
    assert ledger <= used, "the per-source ledger of mixtures (realized and asked shares, passes)"
    assert not used & set(service_metrics.RENAMED.values()), "the dashboard reads the new names"


def test_the_dashboard_is_ready_for_provisioning() -> None:
    """A fixed uid, no import-time inputs, its data source a variable, panels that do not overlap."""
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "dataferry" and "__inputs" not in board and board.get("id") is None
    variables = {v["name"]: v for v in board["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    cells: set[tuple[int, int]] = set()
    prometheus = {"type": "prometheus", "uid": "${datasource}"}
    for panel in board["panels"]:
        assert panel.get("datasource") in (None, prometheus), panel["title"]
        x, y, w, h = (panel["gridPos"][k] for k in "xywh")
        assert x + w <= 24
        mine = {(col, row) for col in range(x, x + w) for row in range(y, y + h)}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    provider = yaml.safe_load(PROVIDER.read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"


# --- the metrics the rules needed -------------------------------------------------------------------


FULL_BODY: dict[str, Any] = {
    "uptime": 5.0, "attached": 1, "workers": 2, "worker_restarts": 1, "rejected_messages": 0,
    "sizing": {"active": 2, "budget": 4.0}, "load": {"load": 1.5, "busy": 0.75, "demand": 2.0},
    "shm": {"free_bytes": 300, "size_bytes": 1000},
    "feeds": [{
        "name": "train", "decoded": 10, "images_per_second": 1.0, "batches": 2, "bad_files": 0,
        "store_waits": 1, "encoded_rows": 4,
        "slots": {"free": 1, "filling": 0, "ready": 0, "leased": 1},
        "cache": {"bytes": 9, "bytes_used": 1, "entries": 1, "hits": 1, "misses": 1, "lock_timeouts": 0},
        "sources": [{"source": "a", "served": 4}, {"source": "b", "served": 6}],
    }],
    "worker_list": [{"worker": 0, "images_per_second": 1.0}],
    "sessions": [{
        "session": "t1", "client": "host:1", "feed": "train", "lag": 0, "credits": 2, "leased": 1,
        "encode_share": 0.5, "demand": 2.0,
        "sources": [{"source": "a", "served": 4, "asked": 0.25, "pass": 0}],
    }],
}  # fmt: skip
"""A status body with only the keys the metrics read (a reader takes what a body gives)."""


def scrape(body: dict[str, Any]) -> dict[str, float]:
    """``name{labels}`` -> value, as Prometheus would store them from the service's page."""
    from prometheus_client import generate_latest

    metrics = service_metrics.ServiceMetrics()
    metrics.update(body)
    metrics.observe_ready_wait("train", 0.01)
    samples = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def test_the_contract_declares_every_metric_the_service_exports() -> None:
    pytest.importorskip("prometheus_client")
    stored = {re.sub(r"\{.*", "", series) for series in scrape(status.to_body(whole_status()))}
    stored = {name for name in stored if not name.endswith("_created")}
    assert stored == exported_names() - {
        f"dataferry_batch_wait_seconds_{part}" for part in ("bucket", "sum", "count")
    }


def test_shm_space_and_the_renamed_ratios_are_exported() -> None:
    """/dev/shm's free and total bytes (DataferrySharedMemoryNearlyFull), and each renamed metric
    under both names with one value until the old name goes."""
    pytest.importorskip("prometheus_client")
    samples = scrape(FULL_BODY)
    assert samples["dataferry_shm_free_bytes"] == 300 and samples["dataferry_shm_size_bytes"] == 1000
    assert samples["dataferry_decode_busy_ratio"] == samples["dataferry_decode_busy"] == 0.75
    asked = '{client="host:1",feed="train",source="a"}'
    assert samples[f"dataferry_trainer_source_asked_ratio{asked}"] == 0.25
    assert f"dataferry_trainer_source_asked_share{asked}" not in samples, "never released: no old name"
    older = scrape({key: value for key, value in FULL_BODY.items() if key != "shm"})
    assert not any(name.startswith("dataferry_shm_") for name in older), "a body without it: no sample"


def test_shm_space_is_what_df_says(tmp_path: Path) -> None:
    space = shm_space(tmp_path)
    fs = os.statvfs(tmp_path)
    assert space is not None and space.size_bytes == fs.f_blocks * fs.f_frsize
    assert 0 <= space.free_bytes <= space.size_bytes
    assert shm_space(tmp_path / "missing") is None
