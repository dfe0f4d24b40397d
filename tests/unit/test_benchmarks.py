"""The benchmark's pure parts: medians, ratios, overlap, flatness, targets, table, JSON, markdown, flags."""

from __future__ import annotations

import dataclasses
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import command_line
from benchmarks.config import ConfigError, make_config, parse_interpolations, parse_scenarios
from benchmarks.machine import cpu_model, mem_total_gib
from benchmarks.proctree import CLOCK_TICKS, parse_stat, parse_status_kib
from benchmarks.report import SCHEMA, format_table, format_value, markdown, to_json
from benchmarks.results import (
    DECODE_LIMIT,
    DL_OPENCV,
    DL_PIL,
    DL_PIPELINE,
    DL_USER,
    FILES,
    LOCAL_SHM,
    REMOTE_CURVE,
    SAVED_ARROW,
    SERVICE,
    SERVICE_TREE,
    SHM,
    TAR_SHARDS,
    TCP_CURVE,
    TCP_PLAIN,
    TFRECORDS,
    TRAINER,
    ZIP_ARCHIVE,
    ZIP_STORED,
    ZMQ_CURVE,
    ZMQ_PLAIN,
    ZMQ_RECEIVER,
    ZMQ_SENDER,
    BenchResults,
    Measurement,
    Timeline,
    evaluate_targets,
)
from benchmarks.stats import growth, is_flat, median, overlap_ratio, paired_ratio, rate, ratio, rolling

# --- stats ---------------------------------------------------------------------------------------


def test_median_ignores_non_finite_and_is_none_for_nothing() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert median([1.0, math.nan, 3.0]) == 2.0
    assert median([]) is None


def test_ratio_refuses_missing_or_non_positive_denominators() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None
    assert ratio(3.0, -1.0) is None


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    # Round 2 ran under a burst of other work that slowed only the second contender: pairing and the
    # median leave it out, the ratio of medians (100/50 = 2.0) would not.
    service = [100.0, 100.0, 100.0]
    other = [50.0, 10.0, 50.0]
    assert paired_ratio(service, other) == 2.0
    assert paired_ratio([200.0, 90.0, 110.0], [100.0, 100.0, 100.0]) == 1.1
    assert paired_ratio([1.0], [1.0, 2.0]) is None
    assert paired_ratio([1.0], [0.0]) is None


def test_rate_of_an_empty_interval_is_zero() -> None:
    assert rate(640, 2.0) == 320.0
    assert rate(640, 0.0) == 0.0


def test_overlap_ratio_against_the_slower_of_load_and_compute() -> None:
    assert overlap_ratio(10.0, 10, load_seconds=1.0, compute_seconds=0.5) == 1.0
    assert overlap_ratio(20.0, 10, load_seconds=1.0, compute_seconds=1.0) == 2.0  # nothing overlapped
    assert overlap_ratio(11.0, 10, load_seconds=0.5, compute_seconds=1.0) == pytest.approx(1.1)
    assert overlap_ratio(1.0, 0, 1.0, 1.0) == math.inf


def test_growth_is_measured_from_the_first_value() -> None:
    assert growth([100.0, 101.0, 99.0]) == 1.0
    assert growth([100.0, 90.0]) == 0.0
    assert growth([100.0]) == 0.0
    assert growth([]) == 0.0


def test_is_flat_allows_the_larger_of_absolute_and_relative_slack() -> None:
    assert is_flat([100.0, 103.9, 102.0], absolute=4.0, relative=0.02)
    assert not is_flat([100.0, 104.1], absolute=4.0, relative=0.02)
    assert is_flat([1000.0, 1019.0], absolute=4.0, relative=0.02)
    assert not is_flat([10.0, 20.0, 30.0, 40.0], absolute=4.0, relative=0.02)  # a leak per epoch
    assert is_flat([], absolute=4.0, relative=0.02)


def test_rolling_rate_and_stall_over_a_window() -> None:
    ends = [1.0, 2.0, 3.0, 4.0]
    points = rolling(ends, [10, 10, 10, 40], [0.5, 0.5, 0.0, 0.0], window=2)
    assert [p.t for p in points] == [2.0, 3.0, 4.0]  # full windows only
    assert [p.images_per_second for p in points] == [10.0, 10.0, 25.0]
    assert [p.stall for p in points] == [0.5, 0.25, 0.0]
    with pytest.raises(ValueError):
        rolling(ends, [1, 1, 1, 1], [0, 0, 0, 0], window=0)


def test_rolling_skips_batches_that_took_no_time() -> None:
    points = rolling([0.0, 1.0], [5, 5], [0.0, 0.0], window=1)
    assert [(p.t, p.images_per_second) for p in points] == [(1.0, 5.0)]


# --- results and targets -------------------------------------------------------------------------


def throughput(
    service: list[float], dl: list[float], limit: list[float], variant: str = "", key: str = "a"
) -> Measurement:
    samples = {SERVICE: service, DL_OPENCV: dl, DL_PIL: [x / 2 for x in dl], DECODE_LIMIT: limit}
    return Measurement("a", key, "one trainer", "images/s", samples, paired=True, variant=variant)


def test_measurement_ratio_pairs_only_paired_samples() -> None:
    paired = throughput([100.0, 100.0, 100.0], [50.0, 10.0, 50.0], [100.0, 100.0, 100.0])
    assert paired.ratio(SERVICE, DL_OPENCV) == 2.0
    unpaired = Measurement("b", "b", "per trainer", "images/s", {SERVICE: [100.0, 30.0], DL_OPENCV: [50.0]})
    assert unpaired.ratio(SERVICE, DL_OPENCV) == 65.0 / 50.0
    assert unpaired.ratio(SERVICE, DL_PIL) is None
    assert unpaired.median(DECODE_LIMIT) is None


def test_timeline_then_shifts_the_later_part() -> None:
    first = Timeline((1.0, 2.0), (64, 64), (0.1, 0.2))
    joined = first.then(Timeline((0.5,), (32,), (0.0,)))
    assert joined.ends == (1.0, 2.0, 2.5)
    assert joined.images == (64, 64, 32)
    assert (Timeline() + first).ends == first.ends


def results_with(*measurements: Measurement) -> BenchResults:
    return BenchResults(
        settings={"quick": True, "batch_size": 64, "image_size": 224, "workers": 2, "data": {"images": 1024}},
        machine={"cpu": "Test CPU", "cores": "2"},
        measurements=measurements,
        timelines={"a:service": Timeline((1.0,), (64,), (0.5,))},
        cleanup={"service_exit_codes": [0], "segments_left": 0},
        started="2026-01-02T03:04:05+00:00",
        seconds=12.0,
    )


def remote_measurements(curve_gb_s: float = 1.2, plain_gb_s: float = 2.5) -> tuple[Measurement, ...]:
    rates = {REMOTE_CURVE: [1000.0, 900.0, 950.0], LOCAL_SHM: [1100.0, 1000.0, 1100.0]}
    transport = {
        TCP_CURVE: [curve_gb_s] * 3,
        TCP_PLAIN: [plain_gb_s] * 3,
        SHM: [50.0] * 3,
        ZMQ_CURVE: [1.5] * 3,
        ZMQ_PLAIN: [2.5] * 3,
    }
    cpu = {SERVICE_TREE: [1.3], TRAINER: [1.2], ZMQ_SENDER: [1.0], ZMQ_RECEIVER: [1.0]}
    return (
        Measurement("j", "j-rate", "remote and local", "images/s", rates, paired=True),
        Measurement("j", "j-transport", "ready batches", "GB/s", transport, paired=True),
        Measurement("j", "j-cpu-tcp_curve", "CPU per GB", "CPU-s/GB", cpu, paired=True),
    )


def byo_measurements(
    pipeline: float = 1.2,
    group: float = 4.0,
    same: tuple[float, ...] = (1.0, 1.0),
    tar: float = 1.01,
    zipped: float = 0.97,
) -> tuple[Measurement, ...]:
    """(h) and (i), with dataferry at ``pipeline``, ``group``, ``tar`` and ``zipped`` times its
    counterpart."""
    return (
        Measurement(
            "h", "h", "pipeline", "images/s", {SERVICE: [pipeline * 200], DL_PIPELINE: [200.0]}, paired=True
        ),
        Measurement("h", "h-cpu", "CPU", "CPU-s", {SERVICE: [5.0], DL_PIPELINE: [5.5]}, paired=True),
        Measurement(
            "h",
            "h-group",
            "group",
            "images/s",
            {SERVICE: [group * 50] * 4, DL_PIPELINE: [50.0] * 4},
            notes={"trainers": 4.0},
        ),
        Measurement("h", "h-equal", "identical", "samples", {SERVICE: list(same)}),
        Measurement(
            "i",
            "i",
            "formats",
            "images/s",
            {
                TAR_SHARDS: [tar * 1000],
                ZIP_ARCHIVE: [zipped * 1000],
                ZIP_STORED: [zipped * 1010],
                SAVED_ARROW: [zipped * 1020],
                TFRECORDS: [zipped * 1030],
                FILES: [1000.0],
            },
            paired=True,
        ),
        Measurement("i", "i-cpu", "CPU", "CPU-s", {TAR_SHARDS: [1.6], FILES: [1.7]}, paired=True),
    )


def eval_measurement(vs_dl: float = 1.4) -> Measurement:
    """(k) with dataferry at ``vs_dl`` times DataLoader+OpenCV."""
    samples = {SERVICE: [vs_dl * 500] * 3, DL_OPENCV: [500.0] * 3, DL_USER: [600.0] * 3}
    return Measurement("k", "k", "eval", "images/s", samples, paired=True, variant="bilinear-antialias")


def cold_measurement(seconds: float = 0.05) -> Measurement:
    notes = {"batch_size": 64.0, "workers": 2.0}
    return Measurement("c", "c-cold", "cold first batch", "s", {SERVICE: [seconds] * 3}, notes=notes)


def full_results() -> BenchResults:
    return results_with(
        throughput([1400.0, 1350.0, 1380.0], [1000.0] * 3, [1450.0] * 3, "bilinear-antialias"),
        throughput([1500.0] * 3, [1100.0] * 3, [1600.0] * 3, "area", key="a-area"),
        Measurement("b", "b", "per trainer", "images/s", {SERVICE: [800.0] * 4, DL_OPENCV: [200.0] * 4}),
        Measurement("c", "c", "first batch", "s", {SERVICE: [0.08, 0.09, 0.2], DL_OPENCV: [0.5]}),
        cold_measurement(),
        Measurement("d", "d", "overlap", "x", {SERVICE: [1.02], DL_OPENCV: [1.4]}, notes={"compute_s": 0.05}),
        Measurement("e", "e64", "next()", "us", {SERVICE: [50.0, 60.0, 70.0]}, notes={"batch_size": 64}),
        Measurement("e", "e256", "next()", "us", {SERVICE: [55.0, 65.0, 75.0]}, notes={"batch_size": 256}),
        Measurement("f", "f", "CPU", "CPU-s", {SERVICE: [2.0], DL_OPENCV: [3.0]}, paired=True),
        Measurement(
            "g",
            "g",
            "memory",
            "MiB",
            {"rss_mib": [300.0, 301.0], "rss_anon_mib": [80.0, 81.0], "shm_mib": [110.0, 110.0]},
        ),
        *byo_measurements(),
        *remote_measurements(),
        eval_measurement(),
    )


def verdicts(results: BenchResults) -> dict[str, list[bool | None]]:
    out: dict[str, list[bool | None]] = {}
    for check in evaluate_targets(results):
        out.setdefault(check.scenario, []).append(check.passed)
    return out


def test_every_target_passes_when_the_figures_meet_it() -> None:
    assert verdicts(full_results()) == {
        "a": [True] * 6,  # three targets per filter, two filters
        "b": [True],
        "c": [True, True],
        "d": [True],
        "e": [True, True],
        "g": [True],
        "h": [True, True, True],
        "i": [True, True, True, True, True],
        "j": [True, True, True],
        "k": [True],
    }


def test_throughput_targets_are_checked_per_filter_against_its_own_rounds() -> None:
    bilinear = throughput([1250.0], [1000.0], [1300.0], "bilinear", key="a-bilinear")  # 1.25x, 2.5x
    area = throughput([1400.0], [1000.0], [1450.0], "area", key="a-area")
    area = dataclasses.replace(area, samples={**area.samples, DL_PIL: [750.0]})  # 1.87x PIL
    checks = {c.target: (c.measured, c.passed) for c in evaluate_targets(results_with(bilinear, area))}
    assert checks["bilinear: dataferry >= 1.3x DataLoader+OpenCV at the same filter"] == ("1.25x", False)
    assert checks["bilinear: dataferry >= 2x DataLoader+PIL"] == ("2.50x", True)
    assert checks["area: dataferry >= 1.3x DataLoader+OpenCV at the same filter"] == ("1.40x", True)
    assert checks["area: dataferry >= 2x DataLoader+PIL"] == ("1.87x", False)
    assert checks["area: dataferry >= 90% of the decode limit"] == ("97%", True)


def test_cold_first_batch_and_eval_targets_fail_above_and_below_their_thresholds() -> None:
    checks = evaluate_targets(results_with(cold_measurement(0.061), eval_measurement(1.29)))
    got = {c.target: (c.measured, c.passed) for c in checks if c.scenario in ("c", "k")}
    assert got["cold first batch <= 0.06 s (batch 64, 2 workers)"] == ("0.061 s", False)
    assert got["eval feed >= 1.3x DataLoader+OpenCV running the same eval transform"] == ("1.29x", False)
    assert got["first batch <= 0.1 s"] == ("not measured", None)


def test_pipeline_and_tar_targets_fail_below_their_thresholds() -> None:
    slow = byo_measurements(pipeline=1.09, group=3.4, same=(1.0, 0.0), tar=0.996, zipped=0.94)
    got = verdicts(results_with(*slow))
    assert got["h"] == [False, False, False]
    assert got["i"] == [False, False, False, True, True]
    checks = {c.target: c.measured for c in evaluate_targets(results_with(*slow))}
    assert checks["tar shards >= 1.0x the same images as files"] == "0.996x"  # not a rounded 1.00x
    assert checks["a zip archive (deflated) >= 0.95x the same images as files"] == "0.940x"
    assert checks["a zip archive (stored) >= 0.95x the same images as files"] == "0.949x"
    assert checks["pipeline, every field identical to the DataLoader's for the same samples"] == "1/2 samples"


def test_a_skipped_scenario_says_why_in_its_targets_table_and_json() -> None:
    base = results_with()
    skipped = dataclasses.replace(base, skipped={"h": "torchvision is not installed"})
    checks = [c for c in evaluate_targets(skipped) if c.scenario == "h"]
    assert len(checks) == 3
    assert all(c.passed is None and c.measured == "skipped: torchvision is not installed" for c in checks)
    assert "skipped (h): torchvision is not installed" in format_table(skipped, evaluate_targets(skipped))
    assert "Skipped (h): torchvision is not installed" in markdown(skipped, evaluate_targets(skipped), "x")
    assert to_json(skipped, evaluate_targets(skipped))["skipped"] == {"h": "torchvision is not installed"}


def test_remote_targets_fail_below_their_thresholds() -> None:
    rates = Measurement(
        "j",
        "j-rate",
        "remote and local",
        "images/s",
        {REMOTE_CURVE: [790.0], LOCAL_SHM: [1000.0]},
        paired=True,
    )
    slow = remote_measurements(curve_gb_s=0.99, plain_gb_s=1.99)
    assert verdicts(results_with(rates, *slow[1:]))["j"] == [False, False, False]


def test_targets_fail_on_the_wrong_side_of_their_thresholds() -> None:
    results = results_with(
        throughput([1100.0], [1000.0], [1300.0]),  # 1.10x DataLoader, 2.2x PIL, 85% of the limit
        Measurement("c", "c", "first batch", "s", {SERVICE: [0.2]}),
        Measurement("e", "e64", "next()", "us", {SERVICE: [50.0]}, notes={"batch_size": 64}),
        Measurement("e", "e256", "next()", "us", {SERVICE: [90.0]}, notes={"batch_size": 256}),  # not flat
        Measurement("g", "g", "memory", "MiB", {"rss_anon_mib": [80.0, 90.0, 100.0], "shm_mib": [110.0] * 3}),
    )
    got = verdicts(results)
    assert got["a"] == [False, True, False]
    assert got["c"] == [False, None]
    assert got["e"] == [True, False]
    assert got["g"] == [False]


def test_targets_of_scenarios_not_run_are_not_applicable() -> None:
    checks = evaluate_targets(results_with())
    assert {c.passed for c in checks} == {None}
    assert {c.verdict for c in checks} == {"n/a"}
    assert all(c.measured == "not measured" for c in checks)
    one_size = results_with(
        Measurement("e", "e64", "next()", "us", {SERVICE: [50.0]}, notes={"batch_size": 64})
    )
    assert verdicts(one_size)["e"] == [None, None]


# --- report --------------------------------------------------------------------------------------


def test_format_value_per_unit() -> None:
    assert format_value(1234.56, "images/s") == "1235"
    assert format_value(0.08123, "s") == "0.081"
    assert format_value(None, "s") == "-"
    assert format_value(math.inf, "x") == "-"


def test_table_has_a_row_per_measurement_ratios_and_verdicts() -> None:
    results = results_with(*reversed(full_results().measurements))  # rows come in scenario order
    table = format_table(results, evaluate_targets(results))
    assert "(a) one trainer, bilinear-antialias, images/s" in table
    assert "(a) one trainer, area, images/s" in table
    assert "(c) first batch, cold, s" in table
    assert "(b) per trainer, 4 at once, images/s" in table
    assert "(e) next() on a ready batch of 64, us" in table
    assert "(e) next() on a ready batch of 256, us" in table
    assert "vs DataLoader+OpenCV 1.38x" in table  # median of 1.4, 1.35, 1.38
    assert "vs DataLoader+PIL 2.76x, vs decode limit 0.95x" in table
    assert "80.0 -> 81.0" in table
    labels = [line.split("  ")[0] for line in table.splitlines() if line.startswith("(")]
    scenarios = [
        *["(a)"] * 2,
        "(b)",
        *["(c)"] * 2,
        "(d)",
        "(e)",
        "(e)",
        "(f)",
        "(g)",
        *["(h)"] * 4,
        *["(i)"] * 2,
        *["(j)"] * 7,
        "(k)",
    ]
    assert [label[:3] for label in labels] == scenarios
    assert labels[1].startswith("(a) one trainer, area")  # the order measured, within a scenario
    assert "of 64" in labels[6] and "of 256" in labels[7]
    passed = "PASS  (a) bilinear-antialias: dataferry >= 1.3x DataLoader+OpenCV at the same filter: 1.38x"
    assert passed in table
    assert "vs DataLoader+OpenCV 1.40x, vs DataLoader, plain cv2 1.17x" in table  # (k)
    assert "FAIL" not in table


def test_pipeline_and_tar_rows_compare_with_their_counterparts() -> None:
    results = results_with(*byo_measurements())
    table = format_table(results, evaluate_targets(results))
    lines = {line.split("  ")[0]: line for line in table.splitlines() if line.startswith(("(h)", "(i)"))}
    one = lines["(h) pipeline, one trainer, images/s"]
    assert "240" in one and "DataLoader running the same function 200, ratio 1.20x" in one
    assert "4.00x" in lines["(h) pipeline, per trainer, 4 in a group, images/s"]
    assert "2/2" in lines["(h) pipeline, samples identical"]
    assert (
        "the same images as files 1000, ratio 1.010x"
        in lines["(i) formats (tar, zip, arrow, tfrecord), one trainer, images/s"]
    )
    doc = to_json(results, evaluate_targets(results))
    assert doc["measurements"]["i"]["ratios"] == {
        "tar_shards/zip_archive": pytest.approx(1.01 / 0.97),
        "tar_shards/zip_stored": pytest.approx(1.01 / 0.9797),
        "tar_shards/files": pytest.approx(1.01),
        "zip_archive/files": pytest.approx(0.97),
        "zip_stored/files": pytest.approx(0.9797),
        "zip_archive/zip_stored": pytest.approx(0.97 / 0.9797),
        "tar_shards/saved_arrow": pytest.approx(1.01 / 0.9894),
        "zip_archive/saved_arrow": pytest.approx(0.97 / 0.9894),
        "zip_stored/saved_arrow": pytest.approx(0.9797 / 0.9894),
        "saved_arrow/files": pytest.approx(0.9894),
        "tar_shards/tfrecords": pytest.approx(1.01 / 0.9991),
        "zip_archive/tfrecords": pytest.approx(0.97 / 0.9991),
        "zip_stored/tfrecords": pytest.approx(0.9797 / 0.9991),
        "saved_arrow/tfrecords": pytest.approx(0.9894 / 0.9991),
        "tfrecords/files": pytest.approx(0.9991),
    }
    assert doc["measurements"]["h"]["ratios"] == {"service/dl_pipeline": pytest.approx(1.2)}
    text = markdown(results, evaluate_targets(results), "python -m benchmarks --scenarios h,i")
    assert "(h) runs the user pipeline" in text


def test_remote_rows_compare_with_the_local_trainer_other_transports_and_tf_data() -> None:
    results = results_with(*remote_measurements())
    table = format_table(results, evaluate_targets(results))
    lines = {line.split("  ")[0]: line for line in table.splitlines() if line.startswith("(j)")}
    remote = lines["(j) remote trainer, TCP+CURVE, images/s"]
    assert "950" in remote and "local shm trainer 1100; remote / local 0.900x" in remote
    curve = lines["(j) ready batches over TCP+CURVE, GB/s"]
    assert "1.20" in curve and "vs raw ZeroMQ, CURVE 0.80x, vs plain TCP 0.48x, vs local shm 0.02x" in curve
    assert "vs tf.data service's 126 MB/s 9.52x" in curve
    assert "tf.data" not in lines["(j) ready batches over local shm, GB/s"]
    assert "tf.data" not in lines["(j) raw ZeroMQ, CURVE (pyzmq alone), GB/s"]
    cpu = lines["(j) CPU-s per GB over TCP+CURVE"]
    assert "2.50" in cpu and "service 1.30 + trainer 1.20" in cpu
    assert "raw ZeroMQ sender 1.00 + receiver 1.00 = 2.00; dataferry / raw 1.25x" in cpu
    doc = to_json(results, evaluate_targets(results))
    ratios = doc["measurements"]["j-transport"]["ratios"]
    assert ratios["tcp_curve/zmq_curve"] == pytest.approx(0.8)
    assert ratios["tcp/shm"] == pytest.approx(0.05)
    assert doc["measurements"]["j-rate"]["ratios"] == {"remote_curve/local_shm": pytest.approx(0.9)}


def test_a_service_is_ready_for_a_transfer_only_when_idle_with_enough_batches() -> None:
    from benchmarks.remote import _ready_workers

    def status(filling: int, ready: int, task: int | None) -> dict[str, object]:
        workers = [{"pid": 11, "task": None}, {"pid": 12, "task": task}]
        return {"feeds": [{"slots": {"free": 2, "filling": filling, "ready": ready}}], "worker_list": workers}

    assert _ready_workers(status(0, 40, None), 40) == [11, 12]
    assert _ready_workers(status(0, 39, None), 40) is None
    assert _ready_workers(status(1, 40, None), 40) is None
    assert _ready_workers(status(0, 40, 7), 40) is None
    assert _ready_workers({}, 40) is None


def test_json_shape_and_strictness() -> None:
    results = full_results()
    doc = to_json(results, evaluate_targets(results))
    text = json.dumps(doc, allow_nan=False)  # NaN/inf would make the file unreadable by strict parsers
    assert json.loads(text)["schema"] == SCHEMA
    assert set(doc) == {
        "schema", "started", "seconds", "settings", "machine", "contenders",
        "measurements", "targets", "timelines", "cleanup", "skipped",
    }  # fmt: skip
    a = doc["measurements"]["a"]
    assert set(a) == {
        "scenario", "title", "unit", "paired", "samples", "median", "ratios", "notes", "variant",
    }  # fmt: skip
    assert a["samples"][SERVICE] == [1400.0, 1350.0, 1380.0]
    assert a["median"][SERVICE] == 1380.0
    assert a["ratios"]["service/dl_opencv"] == pytest.approx(1.38)
    assert a["variant"] == "bilinear-antialias"
    assert doc["measurements"]["a-area"]["variant"] == "area"
    assert doc["measurements"]["b"]["variant"] == ""
    assert set(doc["measurements"]) == {
        "a", "a-area", "b", "c", "c-cold", "d", "e64", "e256", "f", "g", "h", "h-cpu", "h-group", "h-equal",
        "i", "i-cpu", "j-rate", "j-transport", "j-cpu-tcp_curve", "k",
    }  # fmt: skip
    assert doc["targets"][0] == {
        "scenario": "a",
        "target": "bilinear-antialias: dataferry >= 1.3x DataLoader+OpenCV at the same filter",
        "measured": "1.38x",
        "passed": True,
    }
    assert doc["measurements"]["k"]["ratios"]["service/dl_user"] == pytest.approx(700 / 600)
    assert doc["timelines"]["a:service"] == {"end_s": [1.0], "images": [64], "wait_s": [0.5]}


def test_json_of_missing_medians_is_null_not_nan() -> None:
    results = results_with(Measurement("c", "c", "first batch", "s", {SERVICE: []}))
    doc = to_json(results, evaluate_targets(results))
    assert doc["measurements"]["c"]["median"] == {SERVICE: None}
    json.dumps(doc, allow_nan=False)


def test_markdown_has_machine_command_table_and_targets() -> None:
    results = full_results()
    text = markdown(results, evaluate_targets(results), "python -m benchmarks --quick")
    assert text.startswith("## Results of 2026-01-02")
    assert "| cpu | Test CPU |" in text
    assert "`python -m benchmarks --quick`" in text
    assert "| (a) one trainer, bilinear-antialias, images/s | 1380 | 1000 | 500 | 1450 | - |" in text
    assert "| (a) area: dataferry >= 2x DataLoader+PIL | 2.73x | PASS |" in text
    assert "| (c) cold first batch <= 0.06 s (batch 64, 2 workers) | 0.050 s | PASS |" in text
    assert "(c) cold: the service idle and settled" in text
    assert "(k) rows: dataferry's eval feed" in text


def test_reported_settings_hold_no_path_of_this_machine(tmp_path: Path) -> None:
    from benchmarks.datasets import DataSpec
    from benchmarks.run import settings

    cfg = make_config(True, data=tmp_path, json_path=tmp_path / "r.json", markdown_path=tmp_path / "b.md")
    data = DataSpec(tmp_path, "--data", images=10, classes=2, mean_kib=100.0)
    text = json.dumps(settings(cfg, data))
    assert str(tmp_path) not in text
    assert socket.gethostname() not in text
    assert json.loads(text)["data"]["images"] == 10


# --- config, command line, parsers -------------------------------------------------------------


def test_parse_scenarios_orders_and_keeps_unknown_for_validation() -> None:
    assert parse_scenarios("e, a,c") == ("a", "c", "e")
    assert parse_scenarios("j,a") == ("a", "j")
    assert parse_scenarios("j,i,h") == ("h", "i", "j")
    assert parse_scenarios("A,,b") == ("a", "b")
    assert parse_scenarios("a,z") == ("a", "z")


def test_parse_interpolations_keeps_the_order_given_without_duplicates() -> None:
    assert parse_interpolations("area, bilinear,AREA") == ("area", "bilinear")
    cfg = make_config(False, interpolations=parse_interpolations("bilinear,area"))
    assert cfg.interpolation == "bilinear"  # the first is the run's main filter
    assert make_config(False).interpolations == ("bilinear-antialias", "bilinear", "area")


def test_quick_preset_and_overrides() -> None:
    quick = make_config(True, workers=4, images=None)
    assert quick.quick and quick.workers == 4 and quick.images == 1024
    assert make_config(False).images == 2560
    assert make_config(True, images=640).per_class == 80


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workers": 0}, "--workers"),
        ({"images": 10}, "--images"),
        ({"scenarios": ("a", "z")}, "unknown scenarios z"),
        ({"scenarios": ()}, "selects nothing"),
        ({"data": Path("/nonexistent/dataferry-bench")}, "--data"),
        ({"interpolations": ("bilinear", "cubic")}, "unknown interpolations cubic"),
        ({"interpolations": ()}, "--interpolations selects nothing"),
    ],
)
def test_bad_flags_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(False, **overrides)


def test_command_line_hides_the_data_path(tmp_path: Path) -> None:
    cfg = make_config(True, data=tmp_path, workers=3, scenarios=("a", "c"))
    assert command_line(cfg) == "python -m benchmarks --quick --data DIR --workers 3 --scenarios a,c"
    assert command_line(make_config(False)) == "python -m benchmarks"
    assert command_line(make_config(False, images=5000)) == "python -m benchmarks --images 5000"
    assert command_line(make_config(False, rounds=11, scenarios=("h", "i"))) == (
        "python -m benchmarks --rounds 11 --scenarios h,i"
    )
    assert command_line(make_config(False, interpolations=("area",))) == (
        "python -m benchmarks --interpolations area"
    )


def test_cpu_model_and_memory_from_proc_text() -> None:
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R)  Xeon(R) CPU @ 2.20GHz\n"
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    assert cpu_model("processor : 0\nModel : Raspberry Pi 4 Model B\n") == "Raspberry Pi 4 Model B"
    assert mem_total_gib("MemTotal:       24576000 kB\nMemFree: 1 kB\n") == pytest.approx(23.4375)
    assert mem_total_gib("") is None


def test_proc_stat_with_spaces_and_parentheses_in_the_name() -> None:
    fields = ["S", "41", *["0"] * 9, str(3 * CLOCK_TICKS), str(CLOCK_TICKS), "0"]
    ppid, cpu = parse_stat(f"42 (python -m (x)) {' '.join(fields)}")
    assert ppid == 41
    assert cpu == 4.0


def test_proc_status_fields_in_kib() -> None:
    status = "Name:\tpython\nVmRSS:\t  2048 kB\nRssAnon:\t  1024 kB\n"
    assert parse_status_kib(status, "VmRSS") == 2048
    assert parse_status_kib(status, "RssAnon") == 1024
    assert parse_status_kib(status, "RssShmem") == 0


def test_a_missing_matplotlib_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from benchmarks import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert cli.main(["--quick"]) == 2  # a run would take minutes before failing at the plot
    cli._check_plotting(cli.config_from(cli.build_parser().parse_args(["--no-plot"])))


# --- (h) and (i) helpers ---------------------------------------------------------------------------


def test_batch_rows_of_every_contender_kind() -> None:
    import torch

    from benchmarks.contenders import batch_rows

    assert batch_rows((torch.zeros(5, 3), torch.zeros(5))) == 5  # a DataLoader's tuple
    assert batch_rows({"image": torch.zeros(7, 2), "label": torch.zeros(7)}) == 7  # collated dicts


def test_epoch_order_walks_the_services_permutation_epoch_after_epoch() -> None:
    from benchmarks.datasets import EpochOrder
    from loader_service.dataset.sampler import epoch_permutation

    order = EpochOrder(10, seed=3)
    first, second = list(order), list(order)
    assert first == [(0, i) for i in epoch_permutation(3, 0, 10).tolist()]
    assert second == [(1, i) for i in epoch_permutation(3, 1, 10).tolist()]
    assert len(order) == 10


def test_shard_groups_are_consecutive_runs_in_index_order() -> None:
    from benchmarks.datasets import sample_key, shard_groups

    assert shard_groups(600, 256) == [range(0, 256), range(256, 512), range(512, 600)]
    assert shard_groups(256, 256) == [range(0, 256)]
    assert shard_groups(0, 256) == []
    with pytest.raises(ValueError):
        shard_groups(10, 0)
    assert sample_key(42) == "000042"  # no dot: a WebDataset key ends at the first one


def test_same_fields_needs_names_dtypes_shapes_and_bits() -> None:
    import numpy as np
    import torch

    from benchmarks.pipelines import same_fields

    got = {"image": torch.ones(2, 2, dtype=torch.float16), "label": torch.tensor(3)}
    assert same_fields(got, {"image": torch.ones(2, 2, dtype=torch.float16), "label": np.int64(3)})
    assert not same_fields(got, {"image": torch.ones(2, 2, dtype=torch.float32), "label": 3})
    assert not same_fields(got, {"image": torch.ones(1, 4, dtype=torch.float16), "label": 3})
    assert not same_fields(got, {"image": torch.zeros(2, 2, dtype=torch.float16), "label": 3})
    assert not same_fields(got, {"label": 3, "image": torch.ones(2, 2, dtype=torch.float16)})  # order


# --- (a) filters, (c) cold, (k) helpers -------------------------------------------------------------


def test_rounds_of_several_filters_split_into_one_series_set_per_filter() -> None:
    from benchmarks.scenarios import of_variant, variant_key

    rounds = {
        variant_key(SERVICE, "bilinear"): [2.0],
        variant_key(DL_OPENCV, "bilinear"): [1.0],
        variant_key(DL_PIL, ""): [0.5],  # timed once for all filters
        variant_key(SERVICE, "area"): [3.0],
    }
    assert of_variant(rounds, "bilinear") == {SERVICE: [2.0], DL_OPENCV: [1.0], DL_PIL: [0.5]}
    assert of_variant(rounds, "area") == {DL_PIL: [0.5], SERVICE: [3.0]}
    assert of_variant(rounds, "area", shared=False) == {SERVICE: [3.0]}
    assert of_variant(rounds, "bilinear-antialias") == {DL_PIL: [0.5]}  # no prefix match


def test_a_service_has_settled_only_with_every_worker_idle_and_nothing_filling() -> None:
    from benchmarks.scenarios import settled

    def status(task: int | None = None, up: bool = True, filling: int = 0, ready: int = 2) -> dict[str, Any]:
        workers = [{"task": None, "ready": True}, {"task": task, "ready": up}]
        feeds = [{"slots": {"filling": 0, "ready": ready}}, {"slots": {"filling": filling, "ready": 0}}]
        return {"worker_list": workers, "feeds": feeds}

    assert settled(status(), warm=True) and settled(status(ready=0), warm=False)
    assert not settled(status(ready=0), warm=True)  # the warm start is not ready yet
    assert not settled(status(task=3), warm=False)
    assert not settled(status(up=False), warm=False)  # a worker still starting
    assert not settled(status(filling=1), warm=False)  # any feed decoding counts
    assert not settled({}, warm=False)


def test_service_a_config_adds_a_feed_per_other_filter_and_the_eval_feed(tmp_path: Path) -> None:
    import tomllib

    from benchmarks.run import feeds_toml

    data = tmp_path / 'photos "x"'
    text = feeds_toml(data, "bilinear-antialias", ("bilinear", "area"), eval_feed=True)
    feeds = tomllib.loads(text)["feeds"]
    assert list(feeds) == ["train-bilinear", "train-area", "eval"]
    assert feeds["train-area"] == {"data": str(data), "augment": "train", "interpolation": "area"}
    assert feeds["eval"] == {"data": str(data), "augment": "eval", "interpolation": "bilinear-antialias"}
    assert tomllib.loads(feeds_toml(data, "area", (), eval_feed=False)) == {}


def test_the_service_reads_service_a_config_as_meant(tmp_path: Path) -> None:
    from benchmarks.run import feeds_toml
    from loader_service.config.loading import load_config

    data = tmp_path / "data"
    (data / "cls").mkdir(parents=True)
    config = tmp_path / "feeds.toml"
    config.write_text(feeds_toml(data, "bilinear", ("area",), eval_feed=True))
    endpoint = f"ipc://{tmp_path}/s.sock"
    cfg = load_config(
        config, {"data": str(data), "endpoint": endpoint, "interpolation": "bilinear", "seed": 3}, {}
    )
    assert (cfg.augment, cfg.interpolation) == ("train", "bilinear")
    extra = {f.name: (f.augment, f.interpolation, f.seed) for f in cfg.extra_feeds}
    assert extra == {"train-area": ("train", "area", 3), "eval": ("eval", "bilinear", 3)}


def test_plain_eval_is_a_centred_crop_of_the_shorter_side_resized(tmp_path: Path) -> None:
    import cv2
    import numpy as np

    from benchmarks.datasets import PlainEval

    (tmp_path / "cls").mkdir()
    image = np.zeros((120, 200, 3), np.uint8)
    image[:, :, 0] = 255  # blue in OpenCV's BGR
    cv2.imwrite(str(tmp_path / "cls" / "a.png"), image)
    pixels, label = PlainEval(tmp_path, 56)[0]
    assert tuple(pixels.shape) == (3, 56, 56) and label == 0
    assert int(pixels[2].min()) == 255 and int(pixels[0].max()) == 0  # RGB: blue is the last plane
