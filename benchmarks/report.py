"""Turning results into a table for people, JSON for machines and a section for docs/benchmarks/log.md.

All pure: these functions only format what ``results`` holds, so they are unit-tested directly.
Ratios are always dataferry over the other contender, whatever the unit: above 1 means dataferry is
higher (faster for images/s; slower or costlier for seconds, microseconds, CPU and overlap).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.results import (
    CONTENDERS,
    J_SERIES,
    LOCAL_SHM,
    REMOTE_CURVE,
    REMOTE_FAR,
    REMOTE_PLAIN,
    SERIES,
    SERVICE,
    SERVICE_TREE,
    SHM,
    TCP_CURVE,
    TCP_PLAIN,
    TF_DATA_SERVICE_GB_S,
    TRAINER,
    ZMQ_CURVE,
    ZMQ_PLAIN,
    ZMQ_RECEIVER,
    ZMQ_SENDER,
    BenchResults,
    Check,
    Measurement,
    Timeline,
)
from benchmarks.stats import ratio

SCHEMA = "dataferry-bench/1"
COLUMNS = tuple(CONTENDERS)
FORMATS = {
    "images/s": ".0f",
    "s": ".3f",
    "x": ".3f",
    "us": ".0f",
    "CPU-s": ".2f",
    "MiB": ".1f",
    "GB/s": ".2f",
    "CPU-s/GB": ".2f",
}
ROW_LABELS = {
    "a": "(a) one trainer{variant}, images/s",
    "b": "(b) per trainer, {trainers:.0f} at once, images/s",
    "c": "(c) first batch, s",
    "c-cold": "(c) first batch, cold, s",
    "d": "(d) epoch / max(load, compute)",
    "e": "(e) next() on a ready batch of {batch_size:.0f}, us",
    "f": "(f) CPU-s per 1000 images{variant}",
    "g": "(g) service memory, MiB",
    "h": "(h) pipeline, one trainer, images/s",
    "h-cpu": "(h) pipeline, CPU-s per 1000 images",
    "h-group": "(h) pipeline, per trainer, {trainers:.0f} in a group, images/s",
    "h-equal": "(h) pipeline, samples identical",
    "i": "(i) formats (tar, zip, arrow, tfrecord), one trainer, images/s",
    "i-cpu": "(i) tar shards, CPU-s per 1000 images",
    "j-rate": "(j) remote trainer, TCP+CURVE, images/s",
    "j-cpu-images": "(j) remote trainer, CPU-s per 1000 images",
    "j-transport": "(j) ready batches over {series}, GB/s",
    "j-transport-raw": "(j) {series} (pyzmq alone), GB/s",
    "j-cpu-tcp_curve": "(j) CPU-s per GB over TCP+CURVE",
    "j-cpu-tcp": "(j) CPU-s per GB over plain TCP",
    "k": "(k) eval feed, one trainer{variant}, images/s",
    "k-cpu": "(k) eval feed, CPU-s per 1000 images{variant}",
    "l-rate": "(l) remote trainer 50 ms away each way, TCP+CURVE, images/s",
}
"""Row labels by measurement key, else by scenario (``a-bilinear`` is an (a) row); ``{variant}``
becomes ", FILTER" for a measurement that names its resize filter."""
COMPARED = {
    TCP_CURVE: (ZMQ_CURVE, TCP_PLAIN, SHM),
    TCP_PLAIN: (ZMQ_PLAIN, SHM),
    SHM: (),
    ZMQ_CURVE: (ZMQ_PLAIN,),
    ZMQ_PLAIN: (),
}
"""(j) transport rows, in table order, and what each is compared with."""
TARGET_SOURCES = "issue 5; (h), (i): issue 11; (j): issue 12; (a) per filter, (c) cold, (k): issue 13"
COMPARED_NOTE = (
    "(h) and (i) rows hold one figure in the dataferry column (for (i), the service reading tar shards) "
    "and compare it in the last column with what it ran against: a DataLoader running the same pipeline "
    "function, or the same service reading the same images as files."
)
REMOTE_NOTE = (
    "(j) rows hold one figure each in the dataferry column: the remote trainer's, or one transport's "
    "(service and trainer added up for CPU per GB); the note compares it with the local trainer, the "
    "other transports, a raw pyzmq pair on the same kind of TCP, and what a tf.data service consumer "
    "was reported to receive (tensorflow issue #49304, another machine: for scale only)."
)
COLD_NOTE = (
    "(c) cold: the service idle and settled (no worker busy, nothing being decoded), then a trainer "
    "that starts an epoch no cache holds (not the warm start's), so its first batch is decoded after "
    "it asks."
)
EVAL_NOTE = (
    "(k) rows: dataferry's eval feed (shorter side to round(S*256/224), centre crop S) against "
    "DataLoader+OpenCV running the same eval transform after a full decode (`transform_into`), and "
    "DataLoader, plain cv2: a user's own eval code (`cv2.imread`, `cv2.resize` INTER_LINEAR, centre "
    "crop, BGR to RGB, CHW)."
)


@dataclass(frozen=True)
class Row:
    label: str
    cells: Mapping[str, str]
    note: str


def format_value(value: float | None, unit: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, FORMATS.get(unit, ".3g"))


def ratio_note(m: Measurement) -> str:
    """``vs DataLoader+OpenCV 1.27x, ...`` for every other contender measured."""
    parts = []
    for key in COLUMNS:
        if key != SERVICE and key in m.samples:
            r = m.ratio(SERVICE, key)
            parts.append(f"vs {CONTENDERS[key]} {'-' if r is None else f'{r:.2f}x'}")
    return ", ".join(parts)


def _memory_row(m: Measurement) -> Row:
    def span(key: str) -> str:
        series = m.samples.get(key, ())
        return f"{series[0]:.1f} -> {series[-1]:.1f}" if series else "-"

    epochs = len(m.samples.get("rss_mib", ()))
    last = m.samples.get("rss_anon_mib", ())
    note = f"epoch 1 -> {epochs}: RSS {span('rss_mib')}, anon {span('rss_anon_mib')}, shm {span('shm_mib')}"
    return Row(ROW_LABELS["g"], {SERVICE: format_value(last[-1] if last else None, "MiB")}, note)


def _times(value: float | None, places: int = 2) -> str:
    return "-" if value is None else f"{value:.{places}f}x"


def _remote_row(m: Measurement) -> Row:
    """(j) with decoding: the remote trainer's figure; the local trainer's and the ratio beside it
    (to three places for images/s, whose target of 0.8 a rounded 0.796 would seem to meet)."""
    local = format_value(m.median(LOCAL_SHM), m.unit)
    places = 3 if m.key == "j-rate" else 2
    note = f"{J_SERIES[LOCAL_SHM]} {local}; remote / local {_times(m.ratio(REMOTE_CURVE, LOCAL_SHM), places)}"
    if REMOTE_PLAIN in m.samples:
        plain = format_value(m.median(REMOTE_PLAIN), m.unit)
        ratio = _times(m.ratio(REMOTE_PLAIN, LOCAL_SHM), places)
        note += f"; {J_SERIES[REMOTE_PLAIN]} {plain}, / local {ratio}"
    return Row(ROW_LABELS[m.key], {SERVICE: format_value(m.median(REMOTE_CURVE), m.unit)}, note)


def _transport_rows(m: Measurement) -> list[Row]:
    """(j) transport alone: a row per transport, each against what ``COMPARED`` names and, for
    dataferry over TCP, against what a tf.data service consumer was reported to receive."""
    out = []
    for key in (k for k in COMPARED if k in m.samples):
        parts = [
            f"vs {J_SERIES[other]} {_times(m.ratio(key, other))}"
            for other in COMPARED[key]
            if other in m.samples
        ]
        value = m.median(key)
        if key in (TCP_CURVE, TCP_PLAIN) and value is not None:
            tf_data = f"{TF_DATA_SERVICE_GB_S * 1000:.0f} MB/s"
            parts.append(f"vs tf.data service's {tf_data} {_times(value / TF_DATA_SERVICE_GB_S)}")
        template = ROW_LABELS["j-transport-raw" if key in (ZMQ_CURVE, ZMQ_PLAIN) else m.key]
        label = template.format(series=J_SERIES[key])
        out.append(Row(label, {SERVICE: format_value(value, m.unit)}, ", ".join(parts)))
    return out


def _cpu_per_gb_row(m: Measurement) -> Row:
    """(j) CPU per GB: service and trainer added up in the cell; each side, and a raw ZeroMQ pair's
    over the same kind of TCP, in the note."""

    def sides(first: str, second: str) -> tuple[float | None, str]:
        a, b = m.median(first), m.median(second)
        total = None if a is None or b is None else a + b
        text = f"{J_SERIES[first]} {format_value(a, m.unit)} + {J_SERIES[second]} {format_value(b, m.unit)}"
        return total, text

    ours, ours_text = sides(SERVICE_TREE, TRAINER)
    raw, raw_text = sides(ZMQ_SENDER, ZMQ_RECEIVER)
    raw_total = f"raw ZeroMQ {raw_text} = {format_value(raw, m.unit)}"
    note = f"{ours_text}; {raw_total}; dataferry / raw {_times(ratio(ours, raw))}"
    return Row(ROW_LABELS[m.key], {SERVICE: format_value(ours, m.unit)}, note)


def _far_row(m: Measurement) -> Row:
    """(l): the trainer through the delaying proxy; the same trainer without it, and the ratio."""
    near = format_value(m.median(REMOTE_CURVE), m.unit)
    credits = m.notes.get("credits", 0.0)
    note = (
        f"no proxy {near}; 50 ms / none {_times(m.ratio(REMOTE_FAR, REMOTE_CURVE), 3)}; credits {credits:.0f}"
    )
    return Row(ROW_LABELS[m.key], {SERVICE: format_value(m.median(REMOTE_FAR), m.unit)}, note)


def _remote_rows(m: Measurement) -> list[Row]:
    if m.key == "l-rate":
        return [_far_row(m)]
    if m.key == "j-transport":
        return _transport_rows(m)
    if m.unit == "CPU-s/GB":
        return [_cpu_per_gb_row(m)]
    return [_remote_row(m)]


def _identical_row(m: Measurement) -> Row:
    same = m.samples.get(SERVICE, ())
    cell = f"{sum(1 for v in same if v == 1.0)}/{len(same)}"
    note = "samples of a delivered batch whose every field equals the DataLoader's Dataset's, bit for bit"
    return Row(ROW_LABELS[m.key], {SERVICE: cell}, note)


def _compared_row(m: Measurement) -> Row:
    """(h), (i): the first series (dataferry, or dataferry on tar shards) in the dataferry column; each
    other series and the ratio to it in the note (to three places for (i), whose target is 1.0)."""
    if m.key == "h-equal":
        return _identical_row(m)
    first, *others = m.samples
    places = 3 if m.scenario == "i" else 2
    note = "; ".join(
        f"{SERIES.get(o, o)} {format_value(m.median(o), m.unit)}, ratio {_times(m.ratio(first, o), places)}"
        for o in others
    )
    label = ROW_LABELS[m.key].format(**{"trainers": 4.0, **m.notes})
    return Row(label, {SERVICE: format_value(m.median(first), m.unit)}, note)


def row_for(m: Measurement) -> list[Row]:
    """A measurement's rows: the median per contender, then the ratios (for (d), the step's length
    too); one row for every scenario but (j)'s transport, which has one per transport."""
    if m.scenario == "g":
        return [_memory_row(m)]
    if m.scenario in ("j", "l"):
        return _remote_rows(m)
    if m.scenario in ("h", "i"):
        return [_compared_row(m)]
    template = ROW_LABELS.get(m.key) or ROW_LABELS[m.scenario]
    variant = f", {m.variant}" if m.variant else ""
    label = template.format(**{"trainers": 4.0, "batch_size": 0.0, **m.notes, "variant": variant})
    cells = {key: format_value(m.median(key), m.unit) for key in COLUMNS if key in m.samples}
    note = ratio_note(m)
    if m.scenario == "d":
        note = f"step {m.notes.get('compute_s', 0.0) * 1000:.0f} ms; " + note
    return [Row(label, cells, note)]


def rows(results: BenchResults) -> list[Row]:
    """In scenario order, whatever order the run measured them in: (e) by batch size, and in each
    scenario the measurement keyed by its letter (for (a), the main filter) first."""
    ordered = sorted(
        results.measurements,
        key=lambda m: (m.scenario, m.notes.get("batch_size", 0.0), m.key != m.scenario),
    )
    return [row for m in ordered for row in row_for(m)]


def _header() -> list[str]:
    return ["measure", *(CONTENDERS[k] for k in COLUMNS), "dataferry / other"]


def _cells(row: Row) -> list[str]:
    return [row.label, *(row.cells.get(k, "-") for k in COLUMNS), row.note]


def format_table(results: BenchResults, checks: Sequence[Check]) -> str:
    """The human table: medians per contender with ratios, then every target with PASS/FAIL."""
    lines = [_title(results), ""]
    grid = [_header(), *(_cells(r) for r in rows(results))]
    widths = [max(len(line[i]) for line in grid) for i in range(len(grid[0]) - 1)]
    for line in grid:
        first = line[0].ljust(widths[0])
        numbers = [cell.rjust(width) for cell, width in zip(line[1:-1], widths[1:], strict=True)]
        lines.append("  ".join([first, *numbers, line[-1]]).rstrip())
    lines += [f"skipped ({key}): {reason}" for key, reason in results.skipped.items()]
    lines += ["", f"targets ({TARGET_SOURCES}):"]
    lines += [f"  {c.verdict:4}  ({c.scenario}) {c.target}: {c.measured}" for c in checks]
    return "\n".join(lines)


def _title(results: BenchResults) -> str:
    s = results.settings
    data = s.get("data", {})
    kind = "quick run" if s.get("quick") else "full run"
    return (
        f"dataferry vs torch DataLoader ({kind}, {results.seconds:.0f} s): {data.get('images', '?')} images, "
        f"batch {s.get('batch_size')}, {s.get('image_size')} px, {s.get('workers')} processes each; "
        "medians of repeats"
    )


def _shape(data: Mapping[str, Any]) -> str:
    width, height = data.get("mean_width"), data.get("mean_height")
    return f"{width:.0f}x{height:.0f} px, " if width and height else ""


def markdown(results: BenchResults, checks: Sequence[Check], command: str) -> str:
    """The results section for docs/benchmarks/log.md: machine, command, table, targets."""
    s = results.settings
    data = s.get("data", {})
    out = [
        f"## Results of {results.started[:10]}",
        "",
        f"Command: `{command}` ({'quick' if s.get('quick') else 'full'} run, {results.seconds:.0f} s).",
        "",
        f"Data: {data.get('source', '?')}, {data.get('images', '?')} images, "
        f"{data.get('classes', '?')} classes, mean {_shape(data)}{data.get('mean_kib', 0):.0f} KiB. "
        "Every contender: decode, RandomResizedCrop "
        f"{s.get('image_size')} + flip, CHW uint8, batches of {s.get('batch_size')}, "
        f"{s.get('workers')} CPU processes. dataferry's decoder: {s.get('decoder_used', '?')}.",
        *_filters_line(results),
        *_pipeline_line(results),
        "",
        "| machine | |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in results.machine.items()),
        "",
        "| " + " | ".join(_header()) + " |",
        "| " + " | ".join(["---"] + ["---:"] * len(COLUMNS) + ["---"]) + " |",
        *("| " + " | ".join(_cells(r)) + " |" for r in rows(results)),
        "",
        "Medians of repeats; ratios are dataferry over the other contender (above 1: dataferry higher).",
        *_notes(results),
        f"| target ({TARGET_SOURCES}) | measured | result |",
        "| --- | --- | --- |",
        *(f"| ({c.scenario}) {c.target} | {c.measured} | {c.verdict} |" for c in checks),
        "",
    ]
    return "\n".join(out)


def _notes(results: BenchResults) -> list[str]:
    """The paragraphs under the table: how (h), (i) and (j) rows read, and what was skipped; each
    followed by a blank line."""
    scenarios = {m.scenario for m in results.measurements}
    out = [""]
    if scenarios & {"h", "i"}:
        out += [COMPARED_NOTE, ""]
    if "j" in scenarios:
        out += [REMOTE_NOTE, ""]
    if results.get("c-cold"):
        out += [COLD_NOTE, ""]
    if "k" in scenarios:
        out += [EVAL_NOTE, ""]
    out += [f"Skipped ({key}): {reason}" for key, reason in results.skipped.items()]
    return out + ([""] if results.skipped else [])


def _filters_line(results: BenchResults) -> list[str]:
    """Which resize filter each row ran: (a) and (f) name theirs, the rest run the first."""
    filters = list(results.settings.get("interpolations") or [])
    if not filters:
        return []
    timed = ", ".join(f"`{f}`" for f in filters)
    return [
        f"Resize filters: (a) and (f) time dataferry and DataLoader+OpenCV at each of {timed}, the "
        "decode limit at each too, DataLoader+PIL (PIL's bilinear, what torchvision's default pipeline "
        f"costs) once, in the same rounds; every other scenario runs `{filters[0]}`."
    ]


def _pipeline_line(results: BenchResults) -> list[str]:
    """(h) does not run the transform above: say what it runs instead."""
    if not any(m.scenario == "h" for m in results.measurements):
        return []
    pipeline = results.settings.get("pipeline", "?")
    return [
        f"(h) runs the user pipeline `{pipeline}` instead, on both sides: in dataferry's decode workers "
        "(`--pipeline`) and in a DataLoader's workers, on the same samples in the same order."
    ]


def _ratio_pairs(m: Measurement) -> list[tuple[str, str]]:
    """dataferry over every other contender; in (h), (i) and (j), every series over each one after it."""
    if m.scenario in ("h", "i", "j"):
        keys = list(m.samples)
        return [(a, b) for i, a in enumerate(keys) for b in keys[i + 1 :]]
    return [(SERVICE, k) for k in m.samples if k != SERVICE and SERVICE in m.samples]


def _measurement_json(m: Measurement) -> dict[str, Any]:
    medians = {k: m.median(k) for k in m.samples}
    ratios = {f"{a}/{b}": m.ratio(a, b) for a, b in _ratio_pairs(m)}
    return {
        "scenario": m.scenario,
        "title": m.title,
        "unit": m.unit,
        "paired": m.paired,
        "samples": {k: [float(v) for v in vs] for k, vs in m.samples.items()},
        "median": medians,
        "ratios": ratios,
        "notes": dict(m.notes),
        "variant": m.variant,
    }


def _timeline_json(t: Timeline) -> dict[str, list[float] | list[int]]:
    return {"end_s": list(t.ends), "images": list(t.images), "wait_s": list(t.waits)}


def to_json(results: BenchResults, checks: Sequence[Check]) -> dict[str, Any]:
    """Everything measured, every repeat, with medians and ratios precomputed for convenience."""
    return {
        "schema": SCHEMA,
        "started": results.started,
        "seconds": results.seconds,
        "settings": dict(results.settings),
        "machine": dict(results.machine),
        "contenders": {**CONTENDERS, **SERIES},
        "skipped": dict(results.skipped),
        "measurements": {m.key: _measurement_json(m) for m in results.measurements},
        "targets": [
            {"scenario": c.scenario, "target": c.target, "measured": c.measured, "passed": c.passed}
            for c in checks
        ],
        "timelines": {name: _timeline_json(t) for name, t in results.timelines.items()},
        "cleanup": dict(results.cleanup),
    }
