"""What an operator sees of a service, from one status body: ``status`` (rendered and queried) and metrics.

The status queries go to a fake service, a ZeroMQ ROUTER in a thread; ``tests/e2e/test_deploy.py``
asks a real one.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpu_worker.metrics import MetricsUnavailable as TrainerMetricsUnavailable
from gpu_worker.metrics import TrainerMetrics
from loader_service.supervisor.edges.metrics import MetricsUnavailable, ServiceMetrics
from loader_service.tools.status_view import main_status, query_status, render
from protocol.codec import decode, encode
from protocol.messages import Heartbeat, StatusReply, StatusRequest

SAMPLE_BODY: dict[str, Any] = {
    "uptime": 12.3,
    "attached": 2,
    "workers": 2,
    "worker_restarts": 0,
    "rejected_messages": 0,
    "worker_list": [
        {"worker": 0, "pid": 123, "task": 5, "ready": True, "decoded": 640, "images_per_second": 210.5},
        {"worker": 1, "pid": 124, "task": None, "ready": False, "decoded": 0, "images_per_second": 0.0},
    ],
    "feeds": [
        {
            "name": "train",
            "samples": 90,
            "slots": {"free": 8, "filling": 2, "ready": 0, "leased": 2},
            "slots_most": 24,
            "decoded": 640,
            "images_per_second": 400.1,
            "batches": 80,
            "bad_files": 3,
            "encoded_rows": 96,
            "recent_bad_files": ["a/1.jpg", "a/2.jpg", "a/3.jpg", "b/x.jpg"],
            "cache": {
                "kind": "decoded",
                "bytes": 4 * 2**30,
                "bytes_used": 3 * 2**30,
                "entries": 812,
                "hits": 2436,
                "misses": 812,
                "full": True,
            },
        }
    ],
    "sessions": [
        {
            "session": "ab12",
            "client": "host:123",
            "feed": "train",
            "mode": "shard",
            "rank": 0,
            "world_size": 1,
            "group": "",
            "epoch": 3,
            "delivered": 100,
            "leased": 2,
            "credits": 6,
            "lag": 4,
            "idle_seconds": 0.2,
            "demand": 1.5,
            "encode_share": 0.375,
        }
    ],
    "load": {"load": 1.35, "busy": 0.9, "demand": 1.5},
    "sizing": {
        "mode": "auto",
        "active": 6,
        "started": 8,
        "most": 16,
        "budget": 4.0,
        "decisions": [{"seconds_ago": 3.2, "from": 4, "to": 6, "reason": "trainers wait: ..."}],
    },
}


# --- status ---------------------------------------------------------------------------------------


def cells(line: str) -> list[str]:
    return line.split()


def table_row(text: str, first: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first]]
    assert len(rows) == 1, text
    return rows[0]


def test_render_shows_what_an_operator_looks_for() -> None:
    text = render(SAMPLE_BODY)
    assert "up 12.3 s" in text and "2 trainer(s) attached" in text and "0 worker restart(s)" in text
    header = table_row(text, "FEED")
    assert header[:5] == ["FEED", "SAMPLES", "IMAGES/S", "DECODED", "BATCHES"]
    assert header[5:10] == ["FREE", "FILLING", "READY", "LEASED", "MOST"]
    assert table_row(text, "train") == cells("train 90 400.1 640 80 8 2 0 2 24 3")
    assert "a/2.jpg, a/3.jpg, b/x.jpg" in text and "a/1.jpg" not in text  # the last few bad files
    assert (
        "train: sample cache (decoded): 812 entries, 3.00 of 4.00 GiB, full; 2436 hits, 812 misses (75% hits)"
        in text
    )
    assert table_row(text, "WORKER") == ["WORKER", "PID", "READY", "TASK", "DECODED", "IMAGES/S"]
    assert table_row(text, "0") == cells("0 123 yes 5 640 210.5")
    assert table_row(text, "1") == cells("1 124 no - 0 0.0")
    assert table_row(text, "TRAINER")[-4:] == ["CREDITS", "LAG", "DEMAND", "IDLE"]
    assert table_row(text, "ab12") == cells("ab12 host:123 train shard 0/1 3 100 2 6 4 1.5 0.2 s")
    assert "load 1.35 (workers busy 0.90 x trainers' demand 1.50, last 10 s)" in text
    assert (
        "workers: 6 of 8 taking tasks (auto, up to 16, CPU budget 4.0 cores); 4 -> 6 3.2 s ago: "
        "trainers wait: ..." in text
    )


def test_render_copes_with_older_or_partial_bodies() -> None:
    text = render({"uptime": 7200, "feeds": [{"name": "val"}], "sessions": "?", "worker_list": [1, None]})
    assert "up 2 h 00 min" in text
    assert table_row(text, "val") == ["val", *["-"] * 10]
    assert "no trainers attached" in text and "no decode workers reported" in text
    assert "no feeds reported" in render({})


OSC_52 = "\x1b]52;c;cHduZWQ=\x07"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r", "\n")


def test_render_shows_chosen_names_as_text() -> None:
    """NOTE [ Chosen names are shown as text ]: a broadcast group named with a clipboard write, a
    bad file's name with a title escape, a client with a bidi override, a source with a C1 CSI, a
    sizing reason with a carriage return: each as its escapes, none raw (the table is made of lines,
    so a newline is checked in the names only)."""
    session = {**SAMPLE_BODY["sessions"][0], "mode": "broadcast", "group": OSC_52, "client": "c\u202e",
               "sources": [{"source": "s\x9b2J", "served": 1}]}  # fmt: skip
    feed = {**SAMPLE_BODY["feeds"][0], "recent_bad_files": ["a/bad\x1b]0;t\x07\n.jpg"], "format": "f\r"}
    sizing = {**SAMPLE_BODY["sizing"], "decisions": [{"from": 1, "to": 2, "reason": "why\r\x1b[K"}]}
    text = render({**SAMPLE_BODY, "sessions": [session], "feeds": [feed], "sizing": sizing})
    assert not [raw for raw in RAW[:-1] if raw in text], text
    ledger = 3  # a blank line, the sources table's header and its row
    assert len(text.splitlines()) == len(render(SAMPLE_BODY).splitlines()) + ledger, "a name added a line"
    for escaped in (r"\x1b]52;c;cHduZWQ=\x07", r"a/bad\x1b]0;t\x07\n.jpg", "c\\u202e", r"s\x9b2J",
                    r"why\r\x1b[K"):  # fmt: skip
        assert escaped in text, escaped


def test_render_says_what_the_reply_left_out() -> None:
    """NOTE [ A status fits one frame ]: the sessions and feeds the reply had no room for."""
    text = render({**SAMPLE_BODY, "sessions_left_out": 40, "feeds_left_out": 2})
    assert "40 more trainer(s) not listed: the status reply fits one frame" in text
    assert "2 more feed(s) not listed" in text
    assert "not listed" not in render({**SAMPLE_BODY, "sessions_left_out": 0, "feeds_left_out": 0})


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[str]:
    """A ROUTER answering one status request with a heartbeat, a garbage frame, then the sample body."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    def serve() -> None:
        if router.poll(5000):
            rid, frame = router.recv_multipart()
            assert isinstance(decode(frame, (StatusRequest,)), StatusRequest)
            for reply in (encode(Heartbeat()), b"\xc1garbage", encode(StatusReply(SAMPLE_BODY))):
                router.send_multipart([rid, reply])

    thread = threading.Thread(target=serve)
    thread.start()
    yield endpoint
    thread.join(10)
    ctx.destroy(linger=0)


def test_query_status_skips_other_frames_until_the_reply(fake_service: str) -> None:
    assert query_status(fake_service, timeout=5.0) == SAMPLE_BODY


def test_main_status_json_is_sorted_and_indented(
    fake_service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_status(fake_service, as_json=True, timeout=5.0) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == SAMPLE_BODY
    assert out.startswith('{\n  "attached": 2,')


def test_status_of_a_missing_service_names_it_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    with pytest.raises(TimeoutError, match=re.escape(endpoint)):
        query_status(endpoint, timeout=0.2)
    assert main_status(endpoint, as_json=False, timeout=0.2) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no status reply from {endpoint} within 0.2 s" in captured.err
    assert main_status("carrier-pigeon://", as_json=False, timeout=0.2) == 1
    assert "invalid endpoint" in capsys.readouterr().err


# --- metrics --------------------------------------------------------------------------------------


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample the registry exposes, keyed by (name, labels), parsed back from the text format."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_service_metrics_follow_the_status_body() -> None:
    pytest.importorskip("prometheus_client")
    metrics, other = ServiceMetrics(), ServiceMetrics()
    metrics.update(SAMPLE_BODY)
    samples = scrape(metrics.registry)
    train = frozenset({("feed", "train")})
    assert samples[("dataferry_decoded_images_total", train)] == 640
    assert samples[("dataferry_decode_images_per_second", train)] == 400.1
    assert samples[("dataferry_bad_files_total", train)] == 3
    assert samples[("dataferry_encoded_rows_total", train)] == 96
    assert samples[("dataferry_batches_total", train)] == 80
    assert samples[("dataferry_cache_bytes", train)] == 4 * 2**30
    assert samples[("dataferry_cache_used_bytes", train)] == 3 * 2**30
    assert samples[("dataferry_cache_entries", train)] == 812
    assert samples[("dataferry_cache_hits_total", train)] == 2436
    assert samples[("dataferry_cache_misses_total", train)] == 812
    for state, count in {"free": 8, "filling": 2, "ready": 0, "leased": 2}.items():
        assert samples[("dataferry_slots", train | {("state", state)})] == count
    assert samples[("dataferry_worker_restarts_total", frozenset())] == 0
    assert samples[("dataferry_trainers_attached", frozenset())] == 2
    assert samples[("dataferry_uptime_seconds", frozenset())] == 12.3
    assert samples[("dataferry_worker_decode_images_per_second", frozenset({("worker", "0")}))] == 210.5
    trainer = frozenset({("client", "host:123"), ("feed", "train")})  # NOTE [ Trainer series ]: no session
    assert samples[("dataferry_trainer_lag_batches", trainer)] == 4
    assert samples[("dataferry_trainer_credits", trainer)] == 6
    assert samples[("dataferry_trainer_loop_demand", trainer)] == 1.5
    assert samples[("dataferry_trainer_encode_ratio", trainer)] == 0.375
    assert samples[("dataferry_load", frozenset())] == 1.35  # NOTE [ Fleet load ]
    assert samples[("dataferry_decode_busy", frozenset())] == 0.9
    assert samples[("dataferry_demand", frozenset())] == 1.5
    assert samples[("dataferry_decode_workers_active", frozenset())] == 6  # NOTE [ Sizing workers ]
    assert samples[("dataferry_cpu_budget_cores", frozenset())] == 4.0
    assert not any(name.startswith("dataferry_decoded") for name, _ in scrape(other.registry))

    metrics.update({**SAMPLE_BODY, "sessions": [], "worker_restarts": 1})  # the trainer left
    samples = scrape(metrics.registry)
    assert samples[("dataferry_worker_restarts_total", frozenset())] == 1
    assert not any(name.startswith("dataferry_trainer_") for name, _ in samples)


def trainer_series(metrics: ServiceMetrics) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {key for key in scrape(metrics.registry) if key[0].startswith("dataferry_trainer_")}


def rows(session: str, client: str, served: int, feed: str = "train") -> dict[str, Any]:
    ledger = [{"source": "a", "served": served, "asked": 0.5, "pass": 0}]
    return {"session": session, "client": client, "feed": feed, "lag": 1, "credits": 4, "leased": 2,
            "demand": 1.0 + served / 1000, "sources": ledger}  # fmt: skip


def test_trainer_series_follow_trainers_not_sessions() -> None:
    """NOTE [ Trainer series ]: five rounds of 100 sessions of the same trainer, each with a new
    session id (before: one series per session id and family, 2,000 gauges for Prometheus to
    keep), are one series per family; the sessions of one trainer are summed or their largest
    taken; a departed trainer leaves no series."""
    pytest.importorskip("prometheus_client")
    metrics = ServiceMetrics()
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for round_ in range(5):
        sessions = [rows(f"t{100 * round_ + i}", "host:7", i) for i in range(100)]
        metrics.update({**SAMPLE_BODY, "sessions": sessions})
        seen |= trainer_series(metrics)
        metrics.update({**SAMPLE_BODY, "sessions": []})  # the round's sessions left
        assert not trainer_series(metrics), "departed sessions leave no series"
    assert len(seen) == 7, sorted(seen)  # lag, credits, leased, demand; served, asked, pass by source
    metrics.update({**SAMPLE_BODY, "sessions": [rows("x1", "host:7", 10), rows("x2", "host:7", 990),
                                                rows("x3", "host:8", 5, feed="val")]})  # fmt: skip
    samples = scrape(metrics.registry)
    seven = frozenset({("client", "host:7"), ("feed", "train")})
    assert samples[("dataferry_trainer_lag_batches", seven)] == 2, "summed over its sessions"
    assert samples[("dataferry_trainer_leased_batches", seven)] == 4
    assert samples[("dataferry_trainer_loop_demand", seven)] == 1.99, "its largest"
    assert samples[("dataferry_trainer_source_asked_ratio", seven | {("source", "a")})] == 0.5
    assert samples[("dataferry_trainer_credits", frozenset({("client", "host:8"), ("feed", "val")}))] == 4


def test_a_trainers_rows_served_never_go_back_when_one_of_its_sessions_leaves() -> None:
    """NOTE [ Trainer series ]: a sum over live sessions would fall when one leaves, and ``rate()``
    would take the fall for a counter reset and count the whole remaining total again."""
    pytest.importorskip("prometheus_client")
    metrics = ServiceMetrics()
    served = ("dataferry_trainer_source_served_samples_total",
              frozenset({("client", "host:7"), ("feed", "train"), ("source", "a")}))  # fmt: skip
    counts = []
    for sessions in (
        [rows("t1", "host:7", 100)],
        [rows("t1", "host:7", 150), rows("t2", "host:7", 30)],  # a second loader on the same feed
        [rows("t2", "host:7", 50)],  # the first one's session ends
        [rows("t2", "host:7", 80)],
    ):
        metrics.update({**SAMPLE_BODY, "sessions": sessions})
        counts.append(scrape(metrics.registry)[served])
    assert counts == [100, 180, 200, 230]
    metrics.update({**SAMPLE_BODY, "sessions": []})
    assert served not in scrape(metrics.registry)


def test_ready_wait_histogram() -> None:
    pytest.importorskip("prometheus_client")
    metrics = ServiceMetrics()
    metrics.observe_ready_wait("train", 0.003)
    samples = scrape(metrics.registry)
    train = {("feed", "train")}
    assert samples[("dataferry_batch_ready_wait_seconds_bucket", frozenset(train | {("le", "0.0025")}))] == 0
    assert samples[("dataferry_batch_ready_wait_seconds_bucket", frozenset(train | {("le", "0.005")}))] == 1


def test_trainer_batch_wait_histogram_is_served_over_http() -> None:
    pytest.importorskip("prometheus_client")
    metrics = TrainerMetrics()
    for seconds in (0.0002, 0.003, 20.0):
        metrics.observe(seconds, "tcp://a:1")
    metrics.observe(0.5, "tcp://b:1")
    samples = scrape(metrics.registry)

    def bucket(le: str, endpoint: str = "tcp://a:1") -> float:
        return samples[
            ("dataferry_batch_wait_seconds_bucket", frozenset({("le", le), ("endpoint", endpoint)}))
        ]

    assert [bucket(le) for le in ("0.0001", "0.00025", "0.005", "10.0", "+Inf")] == [0, 1, 2, 2, 3]
    assert [bucket(le, "tcp://b:1") for le in ("0.25", "0.5", "+Inf")] == [0, 1, 1]
    metrics.start(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5) as response:
            assert b'dataferry_batch_wait_seconds_count{endpoint="tcp://a:1"} 3.0' in response.read()
    finally:
        metrics.stop()


def test_metrics_without_prometheus_client_name_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(MetricsUnavailable, match="prometheus_client"):
        ServiceMetrics()
    with pytest.raises(TrainerMetricsUnavailable, match="pip install prometheus_client"):
        TrainerMetrics()


def test_render_shows_each_trainers_sources_for_a_feed_of_several() -> None:
    """NOTE [ Source ledger ]: one row per trainer and source; a job without weights has no pass."""
    ledger = [
        {"source": "photos", "served": 120, "share": 0.6, "asked": 0.6, "pass": 1, "position": 20},
        {"source": "extra", "served": 80, "share": 0.4, "asked": 0.4},
    ]
    session = {**SAMPLE_BODY["sessions"][0], "sources": ledger}
    text = render({**SAMPLE_BODY, "sessions": [session]})
    header = [line.split() for line in text.splitlines() if line.split()[:2] == ["TRAINER", "SOURCE"]]
    assert header == [["TRAINER", "SOURCE", "SERVED", "SHARE", "ASKED", "PASS", "POSITION"]]
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["ab12"]]
    assert rows[1:] == [cells("ab12 photos 120 0.6 0.6 1 20"), cells("ab12 extra 80 0.4 0.4 - -")]
    assert "SOURCE" not in render(SAMPLE_BODY), "a feed of one source shows no ledger"
