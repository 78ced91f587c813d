"""Which copy a large same-host read uses: memmove, or streaming stores where they pay on this CPU.

Streaming (non-temporal) stores (``_stream.c``) write a large destination past the cache, which
keeps the engine's working set in it; whether they are also *faster* depends on the CPU. On the
VM the threshold was first tuned on (a 480 MiB L3 reported) a 128 MiB copy ran at 9-10 GB/s
streamed against 6 GB/s through the cache. On a newer VM of the same kind (32 MiB of L3) the same
routine ran at 2.6-3.5 GB/s against 9-19 GB/s for memmove, and a same-host restore from 64 MiB up
fell to a third of memcpy. So the choice is measured on the host: once per process, in the
background, the first time a shm plane is made, both copies of ``CALIBRATION_BYTES`` are timed
(best of ``_REPS``); streaming is used for reads of ``STREAM_MIN_BYTES`` or more only if it was
at least ``_MARGIN`` times as fast. Until the measurement is done every copy is memmove.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Copy = Callable[[int, int, int], object]

STREAM_MIN_BYTES = 64 << 20
CALIBRATION_BYTES = 32 << 20
_REPS = 3
_MARGIN = 1.1


def _load_stream_copy() -> Copy | None:
    """The streaming copy, built from ``_stream.c`` at install when a C compiler was there; else None."""
    try:
        from kvcr.adapters.shm._stream import copy
    except ImportError:  # the optional extension was not built: memmove does every copy
        return None
    return copy


stream_copy = _load_stream_copy()
memmove: Copy = ctypes.memmove


@dataclass(frozen=True, slots=True)
class Measurement:
    """Both copies' speed on this host, in GB/s, over ``nbytes``."""

    nbytes: int
    memmove_gbps: float
    stream_gbps: float

    @property
    def stream_pays(self) -> bool:
        return self.stream_gbps >= _MARGIN * self.memmove_gbps

    @property
    def strategy(self) -> str:
        return "stream" if self.stream_pays else "memmove"


def measure(nbytes: int = CALIBRATION_BYTES, reps: int = _REPS) -> Measurement | None:
    """Time memmove and the streaming copy of ``nbytes`` here (best of ``reps``); None without the extension."""
    if stream_copy is None:
        return None
    src, dst = mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)
    try:
        src.write(b"\x5a" * nbytes)  # touch every page once: no first-fault in the timings
        dst.write(bytes(nbytes))
        s = ctypes.addressof(ctypes.c_char.from_buffer(src))
        d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        best = {}
        for name, copy in (("memmove", memmove), ("stream", stream_copy)):
            copy(d, s, nbytes)  # warm
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                copy(d, s, nbytes)
                times.append(time.perf_counter() - started)
            best[name] = nbytes / max(min(times), 1e-9) / 1e9
        return Measurement(nbytes, best["memmove"], best["stream"])
    finally:
        src.close()
        dst.close()


class _Choice:
    """The process's one measurement, started once in the background (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self.done = threading.Event()
        self.result: Measurement | None = None

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            if stream_copy is None:
                self.done.set()
                return
        threading.Thread(target=self._run, name="kvcr-shm-copy-calibration", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = result = measure()
        except (OSError, ValueError) as exc:  # no memory for the buffers: keep memmove
            log.info("kvcr: shm copy calibration skipped (%s); every copy is memmove", exc)
            return
        finally:
            self.done.set()
        if result is not None:
            log.info(
                "kvcr: shm copies of %d MiB or more use %s (here: memmove %.1f GB/s, streaming %.1f GB/s)",
                STREAM_MIN_BYTES >> 20,
                result.strategy,
                result.memmove_gbps,
                result.stream_gbps,
            )


_choice = _Choice()


def calibrate() -> None:
    """Measure this host's copies once, in the background (the first shm plane calls it)."""
    _choice.start()


def measured(wait_s: float = 0.0) -> Measurement | None:
    """This process's measurement (started now if no plane did), after waiting up to ``wait_s`` for it."""
    _choice.start()
    _choice.done.wait(wait_s)
    return _choice.result


def copier(nbytes: int) -> Copy:
    """How a read of ``nbytes`` copies: streaming where it was measured to pay and the read is large."""
    result = _choice.result
    if stream_copy is not None and nbytes >= STREAM_MIN_BYTES and result is not None and result.stream_pays:
        return stream_copy
    return memmove
