"""A loader's place in its data as a checkpoint holds it: what ``ServiceLoader.state_dict`` writes and
``load_state_dict`` reads back (NOTE [ Elastic epochs ] in protocol/shares.py). Pure: no sockets."""

from __future__ import annotations

from typing import Any, NamedTuple

from protocol.messages import MAX_EPOCH, FeedInfo
from protocol.shares import consumed

STATE_VERSION = 2
"""Version 2 names the job's ``consumed`` prefix (shard mode); version 1 named a rank's position."""


class Resume(NamedTuple):
    """Where a pass begins: an epoch, a batch of this rank's share, and the share's offset."""

    epoch: int
    position: int = 0
    offset: int = 0


def identity(info: FeedInfo, mode: str) -> dict[str, Any]:
    """What must match for a state to be valid: the same data and order. Not the rank, the world
    size or ``remainder`` (NOTE [ Elastic epochs ]), nor the services."""
    return {
        "feed": info.name,
        "fingerprint": info.fingerprint,
        "seed": info.seed,
        "batch_size": info.batch_size,
        "mode": mode,
    }


def state_at(where: Resume, info: FeedInfo, mode: str, world_size: int) -> dict[str, Any]:
    """The state of a loader whose next batch comes from ``where`` (see ``ServiceLoader.state_dict``)."""
    epoch, position, offset = where
    state: dict[str, Any] = {"version": STATE_VERSION, "epoch": epoch, **identity(info, mode)}
    if mode == "broadcast":
        return {**state, "position": position}
    taken = consumed(offset, position, info.batch_size, world_size, info.samples)
    if taken >= info.samples:
        return {**state, "epoch": epoch + 1, "consumed": 0}
    return {**state, "consumed": taken}


def resume_from(state: dict[str, Any], info: FeedInfo, mode: str, world_size: int, batches: int) -> Resume:
    """Where ``state`` continues for this rank (``batches``: its batches of an epoch); ValueError
    naming what is wrong or differs."""
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        raise ValueError("not a ServiceLoader state (missing or unknown 'version')")
    mismatched = [
        f"{key}: state has {state.get(key)!r}, this loader {mine!r}"
        for key, mine in identity(info, mode).items()
        if state.get(key) != mine
    ]
    if mismatched:
        raise ValueError("state belongs to a different feed or setup: " + "; ".join(mismatched))
    epoch = state.get("epoch")
    if type(epoch) is not int or not 0 <= epoch < MAX_EPOCH:
        raise ValueError(
            f"state has an invalid epoch: {epoch!r} (an epoch is an integer in [0, {MAX_EPOCH}))"
        )
    if mode == "broadcast":
        return Resume(epoch, _position_of(state, batches))
    taken = _taken_by_version_1(state, info) if state["version"] == 1 else _taken(state, info)
    if taken >= info.samples:
        return Resume(epoch + 1)
    step = info.batch_size * world_size
    if taken % step == 0:  # a whole number of this job's steps: the epoch's own plan, from there
        return Resume(epoch, taken // step)
    return Resume(epoch, 0, taken)


def _position_of(state: dict[str, Any], batches: int) -> int:
    position = state.get("position")
    if type(position) is not int or not 0 <= position <= batches:
        raise ValueError(f"state has an invalid position: {position!r} (the epoch has {batches} batches)")
    return position


def _taken(state: dict[str, Any], info: FeedInfo) -> int:
    taken = state.get("consumed")
    if type(taken) is not int or not 0 <= taken <= info.samples:
        raise ValueError(f"state has an invalid consumed count: {taken!r} of {info.samples} samples")
    return taken


def _taken_by_version_1(state: dict[str, Any], info: FeedInfo) -> int:
    """A version 1 state's rank position, as the prefix its whole job had taken."""
    world_size = state.get("world_size")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"a version 1 state has an invalid world_size: {world_size!r}")
    position = _position_of(state, 1 << 40)
    return consumed(0, position, info.batch_size, world_size, info.samples)
