"""Types of the C extension built from ``_stream.c``."""

STREAMS: int
"""1 when this build streams past the cache (x86-64 with SSE2), 0 when it copies with memcpy."""

def copy(dst: int, src: int, nbytes: int, /) -> None: ...
