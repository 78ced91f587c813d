"""Metrics: counters, gauges and histograms named by kvcr's catalogue, with closed-set labels.

``name`` is a :class:`~kvcr.ports.metric_catalogue.MetricName` (a ``str`` enum) and every label
value comes from the closed set the catalogue gives that label: never a key, an endpoint or an
id. An adapter refuses anything else: it raises :class:`~kvcr.ports.metric_catalogue.MetricError`
in strict mode (tests) and drops and counts it (``kvcr_metrics_dropped_total``) otherwise.
Calls never block on I/O; exporting is the adapter's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Metrics(Protocol):
    def increment(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        """Add ``value`` (>= 0) to a counter."""

    def set_gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set a gauge."""

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Record one observation of a histogram (durations in seconds)."""

    def snapshot(self) -> Mapping[str, float]:
        """Current counters and gauges (histograms as ``_count`` and ``_sum``), as ``name{k=v}`` -> value."""
