"""Thread-safe in-memory metrics; ``snapshot`` feeds stats pages and SGLang's StorageMetrics."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING


def _series(name: str, labels: Mapping[str, str] | None) -> str:
    if not labels:
        return name
    inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


class InMemoryMetrics:
    """Counters and gauges as floats; histograms keep count and sum."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def increment(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        key = _series(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def set_gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            self._values[_series(name, labels)] = value

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        count, total = _series(f"{name}_count", labels), _series(f"{name}_sum", labels)
        with self._lock:
            self._values[count] = self._values.get(count, 0.0) + 1
            self._values[total] = self._values.get(total, 0.0) + value

    def snapshot(self) -> Mapping[str, float]:
        with self._lock:
            return dict(self._values)


if TYPE_CHECKING:
    from kvcr.ports.metrics import Metrics

    _: Metrics = InMemoryMetrics()
