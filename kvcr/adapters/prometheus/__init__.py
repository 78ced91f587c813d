"""Prometheus adapter: kvcr's catalogue as prometheus_client series, an HTTP exporter, SGLang's /metrics."""

from kvcr.adapters.prometheus.engine import engine_metrics
from kvcr.adapters.prometheus.exporter import MetricsServer, start_exporter
from kvcr.adapters.prometheus.metrics import PrometheusMetrics

__all__ = ["MetricsServer", "PrometheusMetrics", "engine_metrics", "start_exporter"]
