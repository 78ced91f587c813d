"""Metrics: counters, gauges and histograms with low-cardinality labels (never keys or ids)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Metrics(Protocol):
    def increment(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        """Add ``value`` to a counter."""

    def set_gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set a gauge."""

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Record one observation (durations in seconds)."""

    def snapshot(self) -> Mapping[str, float]:
        """Current counters and gauges, flattened as ``name{label=value}`` -> value."""
