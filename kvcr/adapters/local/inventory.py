"""Inventory sinks that need no router: drop events, or keep them for inspection."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvcr.ports.inventory import InventoryEvent


class NullInventory:
    """Publishes nowhere (local L3 with no router)."""

    def publish(self, event: InventoryEvent) -> None:
        del event


class RecordingInventory:
    """Keeps every event in order (tests, ``kvcr inspect``)."""

    def __init__(self) -> None:
        self.events: list[InventoryEvent] = []
        self._lock = threading.Lock()

    def publish(self, event: InventoryEvent) -> None:
        with self._lock:
            self.events.append(event)


if TYPE_CHECKING:
    from kvcr.ports.inventory import InventorySink

    _: InventorySink = NullInventory()
    _r: InventorySink = RecordingInventory()
