"""Real adapters that need nothing beyond this process: host memory, clock, metrics, inventory, what the host has."""

from kvcr.adapters.local.clock import MonotonicClock
from kvcr.adapters.local.host import available_memory_bytes
from kvcr.adapters.local.inventory import NullInventory, RecordingInventory
from kvcr.adapters.local.memory import MmapHostMemory
from kvcr.adapters.local.metrics import InMemoryMetrics

__all__ = [
    "InMemoryMetrics",
    "MmapHostMemory",
    "MonotonicClock",
    "NullInventory",
    "RecordingInventory",
    "available_memory_bytes",
]
