# Typing for the optional C extension built from _mixture.c (see that file for the semantics).
from typing_extensions import Buffer

def choose(
    chosen: Buffer, draw: Buffer, bounds: Buffer, weights: Buffer, total: int, sources: int, /
) -> tuple[int, ...]: ...
