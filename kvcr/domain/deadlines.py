"""Operation and abandonment deadlines.

Every operation has an *operation* deadline (after which the caller is answered with misses)
and a later *abandonment* deadline (after which a transfer that still has not reached a
terminal state is declared UNCERTAIN). Times are seconds on a monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcr.domain.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on the monotonic clock."""

    at: float

    def remaining(self, now: float) -> float:
        return max(0.0, self.at - now)

    def expired(self, now: float) -> bool:
        return now >= self.at


@dataclass(frozen=True, slots=True)
class OperationDeadlines:
    """The two deadlines of one operation."""

    operation: Deadline
    abandon: Deadline


@dataclass(frozen=True, slots=True)
class DeadlineBudget:
    """How long operations may run, and how much longer a transfer may take to settle."""

    operation_s: float
    abandon_s: float

    def __post_init__(self) -> None:
        if self.operation_s <= 0:
            raise ConfigError(f"operation_timeout_ms must be positive, got {self.operation_s * 1000:g}")
        if self.abandon_s < self.operation_s:
            raise ConfigError(
                f"abandon_timeout_ms ({self.abandon_s * 1000:g}) must not be shorter than "
                f"operation_timeout_ms ({self.operation_s * 1000:g})"
            )

    def start(self, now: float) -> OperationDeadlines:
        return OperationDeadlines(Deadline(now + self.operation_s), Deadline(now + self.abandon_s))
