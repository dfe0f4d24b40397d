"""Brace patterns of file names, such as ``shards/train-{000000..000127}.tar`` (WebDataset's notation:
``{a..b}`` ranges keep the zero padding of their ends, ``{x,y}`` lists alternatives, braces nest),
which name several files or objects in one ``--data`` value; and the suffixes of tar shards, which
a store's listing checks too."""

from __future__ import annotations

import re

from loader_service.dataset.tables import DatasetError

TAR_SUFFIX = ".tar"
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tar.lz4")
MAX_SHARDS = 1_000_000
"""More expansions than this is a typo in a pattern, not a dataset."""

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def is_brace_pattern(text: str) -> bool:
    return expand_braces(text) != [text]


def expand_braces(text: str) -> list[str]:
    """Every string the pattern names, in order; text without a brace group is itself."""
    try:
        return _expand(text)
    except _TooMany:
        raise DatasetError(f"pattern {text!r} names more than {MAX_SHARDS} shards") from None


class _TooMany(Exception):
    pass


def _expand(text: str) -> list[str]:
    group = _first_group(text)
    if group is None:
        return [text]
    start, end = group
    head, body, tail = text[:start], text[start + 1 : end], text[end + 1 :]
    choices = _choices(body)
    if choices is None:  # not a brace expression (e.g. "{x}"): keep it literally
        return [head + text[start : end + 1] + rest for rest in _expand(tail)]
    firsts = [c for choice in choices for c in _expand(choice)]
    rests = _expand(tail)
    if len(firsts) * len(rests) > MAX_SHARDS:
        raise _TooMany
    return [head + c + r for c in firsts for r in rests]


def _first_group(text: str) -> tuple[int, int] | None:
    """Positions of the first ``{`` and its matching ``}``, or None."""
    start = text.find("{")
    while start >= 0:
        depth = 0
        for k in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return start, k
        start = text.find("{", start + 1)
    return None


def _choices(body: str) -> list[str] | None:
    parts = _split_top_level(body)
    if len(parts) > 1:
        return parts
    match = _RANGE.match(body)
    if match is None:
        return None
    a, b = match.group(1), match.group(2)
    first, last = int(a), int(b)
    if abs(last - first) >= MAX_SHARDS:
        raise _TooMany
    padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in (a, b))
    width = max(len(a), len(b)) if padded else 0
    step = 1 if last >= first else -1
    return [str(n).zfill(width) for n in range(first, last + step, step)]


def _split_top_level(body: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(body):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(body[start:k])
            start = k + 1
    parts.append(body[start:])
    return parts
