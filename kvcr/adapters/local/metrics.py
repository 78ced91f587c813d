"""Thread-safe in-memory metrics checked against the catalogue; ``snapshot`` feeds stats pages and tests.

Strict mode (tests): an emission the catalogue does not allow raises, so a test that exercises a
call site catches a misspelt name or an open-ended label value. In production it is dropped and
counted in ``kvcr_metrics_dropped_total``, never raised into the serving path.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvcr.ports.metric_catalogue import Kind, MetricError, MetricName, check, series

_MAX_CHECKED = 4096


class InMemoryMetrics:
    """Counters and gauges as floats; histograms keep count and sum.

    Args:
        strict: raise MetricError on an emission the catalogue refuses; when False, drop it and
            count it in ``kvcr_metrics_dropped_total{reason}``.
    """

    def __init__(self, *, strict: bool = False) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        self._strict = strict
        # Series already checked against the catalogue (the hot path emits the same few): bounded
        # by the closed label sets, capped anyway.
        self._checked: dict[tuple[object, ...], str] = {}

    def increment(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        key = self._key(name, Kind.COUNTER, labels)
        if key is not None:
            self._add(key, value)

    def set_gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        key = self._key(name, Kind.GAUGE, labels)
        if key is not None:
            with self._lock:
                self._values[key] = value

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        key = self._key(name, Kind.HISTOGRAM, labels)
        if key is None:
            return
        base, _, inner = key.partition("{")
        suffix = "{" + inner if inner else ""
        count, total = f"{base}_count{suffix}", f"{base}_sum{suffix}"
        with self._lock:
            self._values[count] = self._values.get(count, 0.0) + 1
            self._values[total] = self._values.get(total, 0.0) + value

    def snapshot(self) -> Mapping[str, float]:
        with self._lock:
            return dict(self._values)

    def _key(self, name: str, kind: Kind, labels: Mapping[str, str] | None) -> str | None:
        memo = (name, kind, *labels.items()) if labels else (name, kind)
        key = self._checked.get(memo)
        if key is not None:
            return key
        try:
            spec, given = check(name, kind, labels)
        except MetricError as exc:
            self._refuse(exc)
            return None
        key = series(spec.name.value, given)
        if len(self._checked) < _MAX_CHECKED:
            self._checked[memo] = key
        return key

    def _refuse(self, exc: MetricError) -> None:
        if self._strict:
            raise exc
        self._add(series(MetricName.METRICS_DROPPED.value, {"reason": exc.reason.value}), 1.0)

    def _add(self, key: str, value: float) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value


if TYPE_CHECKING:
    from kvcr.ports.metrics import Metrics

    _: Metrics = InMemoryMetrics()
