# Typing for the optional C extension built from _jpegcrop.c (see that file for the semantics).
LIBJPEG_TURBO_VERSION_NUMBER: int

def header(data: bytes, /) -> tuple[int, int, int, int]: ...
def decode(
    data: bytes, top: int, left: int, height: int, width: int, num: int, /
) -> tuple[bytearray, int, int, int]: ...
