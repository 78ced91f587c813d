"""A clock that moves only when told to (``advance``) or when slept on."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        with self._lock:
            self._now += seconds


if TYPE_CHECKING:
    from kvcr.ports.clock import Clock

    _: Clock = FakeClock()
