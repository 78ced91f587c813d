"""The process's monotonic clock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


if TYPE_CHECKING:
    from kvcr.ports.clock import Clock

    _: Clock = MonotonicClock()
