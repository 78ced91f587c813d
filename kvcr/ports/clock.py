"""Clock: a monotonic time source, injectable so tests control time."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock (never goes backwards)."""

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a fake clock advances instead)."""
