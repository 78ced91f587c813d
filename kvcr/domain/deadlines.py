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


@dataclass(frozen=True, slots=True)
class Timing:
    """Every timing setting of a runner, in seconds: the one source of truth.

    operation_s: a restore (or backup) answers by then, with misses if it must.
    abandon_s: a read still not terminal by then is declared UNCERTAIN.
    control_s: one control round trip (HELLO, LEASE); a live peer answers in well under a
        millisecond, so a stalled one costs this long and then is skipped for ``retry_after_s``.
    connect_s: loading a new peer's data plane and proving it reachable (first contact only).
    lease_s: how long a source holds leased pages; the target accepts a read only if it ended
        before ``sent + lease_s - lease_margin_s`` on its own clock.
    retry_after_s: how long a failed peer is skipped before it is dialled again.
    """

    operation_s: float = 5.0
    abandon_s: float = 10.0
    control_s: float = 0.25
    connect_s: float = 2.0
    lease_s: float = 10.0
    lease_margin_s: float = 0.5
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("operation_s", "abandon_s", "control_s", "connect_s", "lease_s", "retry_after_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ConfigError(f"{_setting(name)} must be in (0, {MAX_TIMEOUT_S * 1000:g}] ms, got {value * 1000:g}")
        if self.abandon_s < self.operation_s:
            raise ConfigError(
                f"abandon_timeout_ms ({self.abandon_s * 1000:g}) must not be shorter than "
                f"operation_timeout_ms ({self.operation_s * 1000:g})"
            )
        if self.control_s > self.operation_s:
            raise ConfigError(
                f"control_timeout_ms ({self.control_s * 1000:g}) must not exceed "
                f"operation_timeout_ms ({self.operation_s * 1000:g})"
            )
        if not 0 <= self.lease_margin_s < self.lease_s:
            raise ConfigError(
                f"lease_ms ({self.lease_s * 1000:g}) must be larger than its margin ({self.lease_margin_s * 1000:g})"
            )

    @property
    def budget(self) -> DeadlineBudget:
        return DeadlineBudget(self.operation_s, self.abandon_s)


MAX_TIMEOUT_S = 3600.0
"""No timing setting may exceed an hour: larger values are typos, and 10**18 ms overflows clocks."""

_SETTING_NAMES = {
    "operation_s": "operation_timeout_ms",
    "abandon_s": "abandon_timeout_ms",
    "control_s": "control_timeout_ms",
    "connect_s": "connect_timeout_ms",
    "lease_s": "lease_ms",
    "retry_after_s": "peer_retry_ms",
}


def _setting(field: str) -> str:
    return _SETTING_NAMES.get(field, field)
