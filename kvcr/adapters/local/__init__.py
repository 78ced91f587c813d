"""Real adapters that need nothing beyond this process: host memory, clock, metrics, inventory."""

from kvcr.adapters.local.clock import MonotonicClock
from kvcr.adapters.local.inventory import NullInventory, RecordingInventory
from kvcr.adapters.local.memory import MmapHostMemory
from kvcr.adapters.local.metrics import InMemoryMetrics

__all__ = [
    "InMemoryMetrics",
    "MmapHostMemory",
    "MonotonicClock",
    "NullInventory",
    "RecordingInventory",
]
