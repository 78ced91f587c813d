"""InventorySink: residency events out of kvcr DRAM (for a router's KV index).

The runner publishes while it holds its index lock, so events arrive in the order the state
changed; a sink must be quick (enqueue, do not send inline).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class InventoryKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class InventoryEvent:
    """Pages of ``pool`` that became resident (in prefix order, after ``parent``) or left."""

    kind: InventoryKind
    pool: str = ""
    page_hashes: tuple[str, ...] = ()
    parent: str | None = None


class InventorySink(Protocol):
    def publish(self, event: InventoryEvent) -> None:
        """Accept one event; must not block or raise."""
