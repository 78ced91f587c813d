"""SGLang's storage metrics (pages and bandwidth per prefetch and backup), bounded.

SGLang drains them through ``get_stats()`` only when ``enable_storage_metrics`` is on; with it
off nothing is recorded, and with it on at most ``MAX_SAMPLES`` of each are kept between drains,
so memory stays flat however long SGLang goes without asking.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

MAX_SAMPLES = 4096


class StorageStats:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._prefetch_pages: deque[int] = deque(maxlen=MAX_SAMPLES)
        self._backup_pages: deque[int] = deque(maxlen=MAX_SAMPLES)
        self._prefetch_bandwidth: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._backup_bandwidth: deque[float] = deque(maxlen=MAX_SAMPLES)

    def prefetch(self, pages: int, nbytes: int, seconds: float) -> None:
        self._record(self._prefetch_pages, self._prefetch_bandwidth, pages, nbytes, seconds)

    def backup(self, pages: int, nbytes: int, seconds: float) -> None:
        self._record(self._backup_pages, self._backup_bandwidth, pages, nbytes, seconds)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        """(prefetch pages, backup pages, prefetch GB/s, backup GB/s) since the last drain."""
        with self._lock:
            result = (
                list(self._prefetch_pages),
                list(self._backup_pages),
                list(self._prefetch_bandwidth),
                list(self._backup_bandwidth),
            )
            for samples in (self._prefetch_pages, self._backup_pages, self._prefetch_bandwidth, self._backup_bandwidth):
                samples.clear()
        return result

    def pending(self) -> int:
        with self._lock:
            return len(self._prefetch_pages) + len(self._backup_pages)

    def _record(self, pages: deque[int], bandwidth: deque[float], count: int, nbytes: int, seconds: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            pages.append(count)
            bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)


def storage_metrics(stats: StorageStats) -> Any:
    """Drain into SGLang's own ``StorageMetrics``."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    return StorageMetrics(*stats.drain())
