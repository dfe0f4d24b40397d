"""``FleetPass``: which service of a fleet decodes which batch, and the order the loop gets them in
(NOTE [ A fleet ] in gpu_worker/fleet_pass.py). Pure: services are names, time is a number."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.fleet_pass import BACKUP_MARGIN, FleetPass

CREDITS = 4


def fleet(*services: str, position: int = 0, end: int = 40) -> FleetPass[str, str]:
    fleet_pass: FleetPass[str, str] = FleetPass(position, end)
    for service in services:
        fleet_pass.joined(service)
    return fleet_pass


def free_of(fleet_pass: FleetPass[str, str], services: tuple[str, ...], waiting: int = 0) -> dict[str, int]:
    return {s: CREDITS - len(fleet_pass.owed(s)) - waiting for s in services}


def test_batches_reach_the_loop_in_plan_order_each_once() -> None:
    d = fleet("a", "b")
    out = d.assign({"a": 2, "b": 2}, now=0.0)
    assert sorted(out["a"] + out["b"]) == [0, 1, 2, 3]
    late = max(out["a"] + out["b"])
    owner = "a" if late in out["a"] else "b"
    assert d.arrived(owner, late, "late", now=1.0)
    assert d.take() is None, "a later batch waits for the ones before it"
    for service, seqs in out.items():
        for seq in seqs:
            if seq != late:
                assert d.arrived(service, seq, f"{seq}", now=1.0)
    assert not d.arrived(owner, late, "again", now=1.0), "a second copy is not handed out"
    taken = [got[1] for got in iter(d.take, None)]
    assert taken == ["0", "1", "2", "late"] and d.position == 4


def test_a_lost_service_s_batches_go_first_to_the_others() -> None:
    d = fleet("a", "b")
    out = d.assign({"a": 2, "b": 2}, now=0.0)
    lost = d.lost("b")
    assert lost == sorted(out["b"]) and d.reassigned == 2
    again = d.assign({"a": 2}, now=1.0)
    assert again["a"] == sorted(out["b"]), "the batches the loop waits for longest are given out first"
    # b comes back with its session: what it still delivers of them is a second copy
    d.joined("b")
    for seq in out["b"]:
        assert d.arrived("a", seq, "a", now=2.0)
        assert not d.arrived("b", seq, "b", now=2.0)
    assert d.owed("b") == set(), "its credits come back as its copies arrive"


def test_a_straggler_gets_only_what_it_can_do_in_time() -> None:
    """Two services deliver a batch a second, one every five: the slow one is never more than one
    batch behind, so the loop never waits on it for long (static striping would give it a third)."""
    d = fleet("fast1", "fast2", "slow")
    pace = {"fast1": 1.0, "fast2": 1.0, "slow": 5.0}
    busy_until = {s: 0.0 for s in pace}
    in_flight: dict[str, list[tuple[float, int]]] = {s: [] for s in pace}
    given: dict[str, int] = dict.fromkeys(pace, 0)
    now = 0.0
    most_behind = 0
    for _ in range(400):
        free = {s: CREDITS - len(d.owed(s)) for s in pace}
        for service, seqs in d.assign(free, now).items():
            for seq in seqs:
                busy_until[service] = max(busy_until[service], now) + pace[service]
                in_flight[service].append((busy_until[service], seq))
                given[service] += 1
        most_behind = max(most_behind, len(in_flight["slow"]))
        now += 0.25
        for service, queue in in_flight.items():
            while queue and queue[0][0] <= now:
                _, seq = queue.pop(0)
                d.arrived(service, seq, service, now)
        while d.take() is not None:
            pass
        if d.done:
            break
    assert d.done
    assert most_behind <= 2, "the slow service is tried with two batches, then given one at a time"
    assert 0 < given["slow"] < given["fast1"] / 2, given


def test_room_is_made_for_the_batch_the_loop_needs() -> None:
    """Every credit is taken by batches waiting behind the one the loop needs, whose service was
    lost: the latest waiting batch is let go and asked for again later."""
    d = fleet("a", "b", end=8)
    d.assign({"a": 1}, now=0.0)  # a: 0
    d.assign({"b": 2}, now=0.0)  # b: 1, 2
    for seq in (1, 2):
        assert d.arrived("b", seq, f"b{seq}", now=1.0)
    d.lost("a")
    assert d.make_room({"b": 0}) == ("b", "b2")
    assert d.make_room({"b": 1}) is None, "not while a credit is free"
    out = d.assign({"b": 1}, now=2.0)
    assert out == {"b": [0]}, "the freed credit goes to the batch the loop needs"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=200))
def test_whatever_arrives_the_loop_sees_each_batch_once_in_order(events: list[tuple[str, bool]]) -> None:
    """Services deliver what they owe in any order, sometimes twice, sometimes get lost and come
    back: the loop still gets 0, 1, 2, ... each once."""
    d = fleet("a", "b", "c", end=30)
    taken: list[int] = []
    now = 0.0
    for service, lose in events + [(s, False) for _ in range(60) for s in "abc"]:
        now += 1.0
        if lose:
            d.lost(service)
            d.joined(service)
        free = {s: CREDITS - len(d.owed(s)) for s in "abc"}
        d.assign(free, now)
        owed = sorted(d.owed(service))
        if owed:
            seq = owed[len(taken) % len(owed)]
            d.arrived(service, seq, service, now)
        while (got := d.take()) is not None:
            taken.append(d.position - 1)
            assert got[1] in "abc"
    assert taken == list(range(len(taken)))
    assert d.done and taken == list(range(30))


def test_a_service_that_never_joined_this_pass_can_be_forgotten_and_join() -> None:
    """A service that first answers mid-pass: its new session is forgotten, then it joins."""
    d = fleet("a")
    d.forget("b")
    d.joined("b")
    out = d.assign({"a": 0, "b": 2}, now=0.0)
    assert out == {"b": [0, 1]}


def simulate(d: FleetPass[str, str], pace: dict[str, float], step: float = 0.05) -> tuple[float, float]:
    """Run a pass to its end with services delivering in order at their paces; (the time it took,
    the loop's longest wait between two batches). The loop itself takes no time."""
    queued: dict[str, list[int]] = {s: [] for s in pace}
    working: dict[str, tuple[float, int] | None] = dict.fromkeys(pace)
    now, last_take, longest = 0.0, 0.0, 0.0
    while not d.done:
        free = {s: CREDITS - len(d.owed(s)) for s in pace}
        for service, seqs in d.assign(free, now).items():
            queued[service] += seqs
        for service, seconds in pace.items():  # one batch at a time, the lowest asked for first
            if working[service] is None and queued[service]:
                queued[service].sort()
                working[service] = (now + seconds, queued[service].pop(0))
        now += step
        for service, job in working.items():
            if job is not None and job[0] <= now:
                d.arrived(service, job[1], service, now)
                working[service] = None
        while d.take() is not None:
            longest, last_take = max(longest, now - last_take), now
        assert now < 1000, "the pass never ended"
    return now, longest


def test_the_loop_waits_on_a_straggler_no_longer_than_about_two_fast_batches() -> None:
    """A fresh pass: nothing is known of the services' paces, so the straggler (5 s a batch, the
    others 1 s) gets trial batches the loop soon needs, the first one maybe. Each is asked of a
    fast service too once the straggler has taken twice what that one would: the loop waits at
    most three fast batch times at once (two waited, one to decode it again), not the straggler's
    five, and the pass takes no longer than the two fast services alone would."""
    d = fleet("fast1", "fast2", "slow", end=40)
    took, longest = simulate(d, {"fast1": 1.0, "fast2": 1.0, "slow": 5.0})
    assert longest <= (BACKUP_MARGIN + 1) * 1.0 + 0.1 and d.backups >= 1, (longest, d.backups)
    alone = fleet("fast1", "fast2", end=40)
    took_alone, _ = simulate(alone, {"fast1": 1.0, "fast2": 1.0})
    assert took <= took_alone + 0.5, (took, took_alone)
    steady = fleet("a", "b", "c", end=40)
    simulate(steady, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert steady.backups == 0, "services alike ask nothing twice"
