"""InventorySink: residency events out of kvcr DRAM (for a router's KV index).

Call order: the runner calls ``InventorySink.publish`` while it holds its index lock, so events
arrive in the order the state changed; a sink must be quick (enqueue, do not send inline).

A router-facing sink usually translates these events into an engine's wire events and hands
them, a batch at a time, to a ``KvEventPublisher`` (a socket drained by its own thread):
``publish`` any number of times, then ``close`` once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol


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


class KvEventPublisher(Protocol):
    """Sends batches of KV events (plain maps, an engine's wire shape) to routers, in order."""

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one batch; never blocks or raises. The publisher owns ``events`` from here on.

        Args:
            events: the batch, sent as one message with the next sequence number.
        """

    def close(self) -> None:
        """Send what is queued (within a bounded time), then release the socket. Idempotent."""
