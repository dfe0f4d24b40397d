# Typing for the optional C extension built from _resample.c (see that file for the semantics).
from typing_extensions import Buffer

def resize(
    src: Buffer,
    height: int,
    width: int,
    dst: Buffer,
    out_height: int,
    out_width: int,
    top: int = 0,
    left: int = 0,
    rows: int = -1,
    cols: int = -1,
    /,
) -> None: ...
