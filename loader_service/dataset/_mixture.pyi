# Typing for the optional C extension built from _mixture.c (see that file for the semantics).
from typing_extensions import Buffer

def walk(
    chosen: Buffer,
    draw: Buffer,
    marks: Buffer,
    stride: int,
    first: int,
    stop: int,
    bounds: Buffer,
    weights: Buffer,
    total: int,
    sources: int,
    deficit: Buffer,
    drawn: Buffer,
    /,
) -> None: ...
