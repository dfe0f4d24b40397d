"""NOTE [ Status contract ]: the status body's one declaration holds together, the body a service
makes is exactly it, and what ``status``, ``top`` and the metrics read of a body is declared there."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from loader_service.supervisor.slots import SlotState
from loader_service.tools import status_view, top
from protocol import status
from protocol.status import ServiceStatus
from tests.helpers import whole_status

METRIC_NAME = re.compile(r"dataferry_[a-z][a-z0-9_]*")


def declared_keys() -> set[str]:
    return {status.key_of(f) for cls in status.records() for f in fields(cls)}


def test_every_field_has_a_meaning_and_every_metric_a_sound_name() -> None:
    seen: set[str] = set()
    for cls in status.records():
        assert cls.__doc__, cls
        keys = [status.key_of(f) for f in fields(cls)]
        assert len(set(keys)) == len(keys), cls
        for label, key in cls.LABELS:
            assert key in keys, (cls, label)
        for f in fields(cls):
            assert status.meaning_of(f).endswith("."), (cls, f.name)
            metric = status.metric_of(f)
            if metric is None:
                continue
            assert METRIC_NAME.fullmatch(metric.name) and metric.name not in seen, metric.name
            seen.add(metric.name)
            assert not metric.name.endswith("_total"), "Prometheus adds it to a counter"
            assert metric.kind in ("gauge", "counter")
            per_session = any(c.IDENTITY for c in status.paths()[cls])
            assert (metric.combine is not None) == per_session, (metric.name, "NOTE [ Trainer series ]")
            assert metric.combine != "counted" or metric.kind == "counter", metric.name
    assert len(seen) > 30


def test_a_feeds_slot_states_are_the_pools() -> None:
    assert tuple(state.value for state in SlotState) == status.SLOT_STATES


def test_the_body_is_the_declaration_with_its_keys() -> None:
    """Python keywords travel under their keys (``pass``, ``from``, ``to``); nested records and
    rows are maps and lists; the labels follow the records down."""
    body = status.to_body(whole_status())
    assert set(body) == {status.key_of(f) for f in fields(ServiceStatus)}
    assert body["sessions"][0]["sources"][0]["pass"] == 1
    decision = {"seconds_ago": 1.0, "from": 1, "to": 2, "reason": "trainers waited"}
    assert body["sizing"]["decisions"] == [decision]
    assert body["feeds"][0]["cache"]["bytes"] == 9 and body["shm"]["floor_bytes"] == 1
    given = {(s.metric.name, s.labels): s for s in status.samples(body)}
    slot = given[("dataferry_slots", (("feed", "train"), ("state", "ready")))]
    assert slot.value == 1 and slot.session == ""
    ledger = (("client", "host:1"), ("feed", "train"), ("source", "a"))
    passes = given[("dataferry_trainer_source_pass", ledger)]
    assert passes.value == 1 and passes.session == "t1"
    assert given[("dataferry_cache_hits", (("feed", "train"),))].value == 1
    declared = {metric.name for _, metric in status.metrics()}
    assert {name for name, _ in given} == declared, "the whole body gives every metric"


@pytest.mark.parametrize("junk", [None, "x", 3, [], {"feeds": "x", "sessions": [1, {"lag": "3"}]}])
def test_a_body_of_the_wrong_shape_gives_no_samples_and_no_error(junk: Any) -> None:
    body = junk if isinstance(junk, dict) else {"feeds": [junk], "load": junk, "sizing": junk}
    assert list(status.samples(body)) == []


def keys_read(module: Any, frame_keys: frozenset[str] = frozenset()) -> set[str]:
    """The string keys a module reads with ``.get("...")`` or ``_records(..., "...")``."""
    tree = ast.parse(Path(module.__file__).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        args = node.args[:1] if name == "get" else node.args[1:2] if name == "_records" else []
        found |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return found - frame_keys


def test_status_and_top_read_only_declared_keys() -> None:
    """A key misspelt or renamed on one side would show ``-`` for ever; here it fails. ``top``'s
    own frame keys (``build_frame``'s) are its, not the body's."""
    body = status.to_body(whole_status())
    frame = top.build_frame("ipc://x", (2.0, body), (1.0, body))
    frame_keys = frozenset(set(frame) | set(frame["store"]) | {k for t in frame["trainers"] for k in t})
    assert keys_read(status_view) and keys_read(status_view) <= declared_keys()
    assert keys_read(top, frame_keys) <= declared_keys(), keys_read(top, frame_keys) - declared_keys()


def test_status_shows_every_part_of_a_whole_body() -> None:
    text = status_view.render(status.to_body(whole_status()))
    assert "trainers waited" in text and "x.jpg" in text and "host:1" in text and "(auto, up to 4" in text
