"""Per-page outcomes of a restore.

RESTORED: every required piece arrived in time. MISS: the page was not available (not held,
stale hint, peer gone or refused). FAILED: a transfer was attempted and did not complete.
UNCERTAIN: a transfer could not be confirmed stopped, so the destination may still change.
Outcomes only get worse: a late success never turns a failure into a success.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Outcome(str, enum.Enum):
    RESTORED = "restored"
    MISS = "miss"
    FAILED = "failed"
    UNCERTAIN = "uncertain"


_RANK = {Outcome.RESTORED: 0, Outcome.MISS: 1, Outcome.FAILED: 2, Outcome.UNCERTAIN: 3}


@dataclass(frozen=True, slots=True)
class PageOutcome:
    """What happened to one page, and why when it was not restored."""

    outcome: Outcome
    reason: str | None = None

    @property
    def restored(self) -> bool:
        return self.outcome is Outcome.RESTORED

    def worsen(self, other: PageOutcome) -> PageOutcome:
        """The worse of the two outcomes (ties keep ``self``)."""
        return other if _RANK[other.outcome] > _RANK[self.outcome] else self


RESTORED = PageOutcome(Outcome.RESTORED)


def miss(reason: str) -> PageOutcome:
    return PageOutcome(Outcome.MISS, reason)


def failed(reason: str) -> PageOutcome:
    return PageOutcome(Outcome.FAILED, reason)


def uncertain(reason: str) -> PageOutcome:
    return PageOutcome(Outcome.UNCERTAIN, reason)


def restored_prefix(outcomes: Sequence[PageOutcome]) -> int:
    """Number of leading RESTORED pages (what an engine may consume)."""
    for i, page in enumerate(outcomes):
        if not page.restored:
            return i
    return len(outcomes)
