"""kvcr metrics on SGLang's own ``/metrics``.

How SGLang 0.5.23 collects metrics: with ``--enable-metrics`` its launcher sets
``PROMETHEUS_MULTIPROC_DIR`` (a temporary directory, or a fresh one inside the directory the
operator set) before it starts the scheduler processes, so prometheus_client in every scheduler
writes its samples to mmap files there; the HTTP server mounts ``/metrics`` on a registry with
``multiprocess.MultiProcessCollector``, which merges the files of every process. The HiCache
storage backend lives in the scheduler process, so series that kvcr creates there are merged into
SGLang's page like SGLang's own (counters summed across TP ranks, kvcr gauges as ``livesum``).
SGLang tells the backend whether metrics are on through ``HiCacheStorageConfig.enable_storage_metrics``.
"""

from __future__ import annotations

import logging
import os
import threading

from kvcr.adapters.prometheus.metrics import PrometheusMetrics

log = logging.getLogger(__name__)

_lock = threading.Lock()
_by_process: dict[int, PrometheusMetrics] = {}


def engine_metrics(enabled: bool, *, strict: bool = False) -> PrometheusMetrics | None:
    """This process's kvcr metrics for the engine's ``/metrics``, or None when the engine's metrics are off.

    One object per process: prometheus_client keeps one sample file (multiprocess mode) or one
    registration (default registry) per series name, so a second set of families would clash.
    The families go into prometheus_client's default registry too, which a single-process
    engine exposes.

    Args:
        enabled: the engine's switch (SGLang: ``storage_config.enable_storage_metrics``).
        strict: raise on an emission the catalogue refuses (tests); the first call decides.
    """
    if not enabled:
        return None
    with _lock:
        metrics = _by_process.get(os.getpid())
        if metrics is None:
            from prometheus_client import REGISTRY, values

            if _multiprocess_dir() and values.ValueClass is values.MutexValue:
                log.warning(
                    "kvcr metrics: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set; "
                    "this process's kvcr series will not reach the engine's /metrics"
                )
            metrics = _by_process[os.getpid()] = PrometheusMetrics(REGISTRY, strict=strict)
        return metrics


def _multiprocess_dir() -> str | None:
    # prometheus_client also honours the lower-case spelling, so the check does too
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112
