"""The Metrics port over prometheus_client, one series family per catalogue entry.

Every family is created up front (HELP and TYPE show before the first event) and, where a
metric's labels have at most 16 combinations, every child too, so a dashboard sees a 0 rather
than a gap. An emission the catalogue refuses raises in strict mode (tests) and otherwise is
dropped, counted in ``kvcr_metrics_dropped_total{reason}`` and logged once per distinct problem.

Gauges aggregate across processes as ``livesum`` when prometheus_client runs in multiprocess
mode (SGLang's scheduler processes, one per TP rank): a DRAM gauge then reads as the server's
total. Elsewhere the mode is ignored.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvcr.ports.metric_catalogue import (
    SPECS,
    DropReason,
    Kind,
    MetricError,
    MetricName,
    MetricSpec,
    check,
    series,
)

log = logging.getLogger(__name__)

_PREFILL_LIMIT = 16
_MAX_CHILDREN = 4096
_LOGGED_LIMIT = 32  # distinct drop messages logged per adapter; later ones are only counted


class PrometheusMetrics:
    """kvcr metrics as prometheus_client Counter / Gauge / Histogram objects.

    Args:
        registry: where to register the families (a ``CollectorRegistry`` to expose with
            ``start_exporter``, prometheus_client's default ``REGISTRY``, or None to register
            nowhere, as in multiprocess mode where the files are what gets collected).
        strict: raise MetricError on an emission the catalogue refuses instead of dropping it.
    """

    def __init__(self, registry: Any = None, *, strict: bool = False) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        self._strict = strict
        self._families: dict[str, tuple[MetricSpec, Any]] = {}
        self._logged: set[str] = set()
        self._children: dict[tuple[object, ...], Any] = {}  # series already checked, the hot path's few
        self._lock = threading.Lock()
        for spec in SPECS:
            common: dict[str, Any] = {
                "name": spec.name.value,
                "documentation": spec.help,
                "labelnames": spec.label_names,
                "registry": registry,
            }
            family: Any
            if spec.kind is Kind.COUNTER:
                family = Counter(**common)
            elif spec.kind is Kind.GAUGE:
                family = Gauge(**common, multiprocess_mode=spec.aggregate)
            else:
                family = Histogram(**common, buckets=spec.buckets)
            self._families[spec.name.value] = (spec, family)
            _prefill(spec, family)

    def increment(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        if value < 0:
            self._refuse(MetricError(DropReason.BAD_VALUE, f"counter {name!s} cannot go down"))
            return
        self._emit(Kind.COUNTER, name, labels, _inc(value))

    def set_gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self._emit(Kind.GAUGE, name, labels, lambda child: child.set(value))

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        self._emit(Kind.HISTOGRAM, name, labels, lambda child: child.observe(value))

    def snapshot(self) -> Mapping[str, float]:
        values: dict[str, float] = {}
        for spec, family in self._families.values():
            wanted = _snapshot_samples(spec)
            for metric in family.collect():
                for sample in metric.samples:
                    if sample.name in wanted:
                        values[series(sample.name, sample.labels)] = float(sample.value)
        return values

    def _emit(self, kind: Kind, name: str, labels: Mapping[str, str] | None, act: Callable[[Any], None]) -> None:
        memo = (name, kind, *labels.items()) if labels else (name, kind)
        child = self._children.get(memo)
        if child is None:
            try:
                spec, given = check(name, kind, labels)
            except MetricError as exc:
                self._refuse(exc)
                return
            family = self._families[spec.name.value][1]
            child = family.labels(**given) if given else family
            if len(self._children) < _MAX_CHILDREN:  # bounded by the closed label sets; capped anyway
                self._children[memo] = child
        act(child)

    def _refuse(self, exc: MetricError) -> None:
        if self._strict:
            raise exc
        self._families[MetricName.METRICS_DROPPED.value][1].labels(reason=exc.reason.value).inc()
        message = str(exc)
        with self._lock:
            first = message not in self._logged and len(self._logged) < _LOGGED_LIMIT
            if first:
                self._logged.add(message)
        if first:
            log.warning("kvcr metrics: dropped an emission (%s): %s", exc.reason.value, message)


def _inc(value: float) -> Callable[[Any], None]:
    return lambda child: child.inc(value)


def _prefill(spec: MetricSpec, family: Any) -> None:
    if not spec.labels:
        return
    if spec.combos is not None:
        combos: list[tuple[str, ...]] = sorted(spec.combos)
    else:
        combos = list(itertools.product(*(sorted(allowed) for _, allowed in spec.labels)))
    if len(combos) > _PREFILL_LIMIT or spec.name is MetricName.BUILD_INFO:  # build info: only the running build
        return
    names = spec.label_names
    for combo in combos:
        family.labels(**dict(zip(names, combo, strict=True)))


def _snapshot_samples(spec: MetricSpec) -> frozenset[str]:
    name = spec.name.value
    if spec.kind is Kind.HISTOGRAM:
        return frozenset({f"{name}_count", f"{name}_sum"})
    return frozenset({name})


if TYPE_CHECKING:
    from kvcr.ports.metrics import Metrics

    _: Metrics = PrometheusMetrics()
