"""An HTTP ``/metrics`` endpoint for a standalone kvcr process (worker, demo, soak, bench).

Inside SGLang nothing here is needed: SGLang serves its own ``/metrics`` (see ``engine.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvcr.domain.errors import ConfigError


@dataclass
class MetricsServer:
    """A running exporter; ``port`` is the bound one (useful when 0 was asked for)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_exporter(registry: Any, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` (e.g. ``PrometheusMetrics(CollectorRegistry()).registry``) on ``host:port``.

    Binds loopback unless told otherwise: a scrape from another host needs ``host="0.0.0.0"``
    (the series carry no keys or endpoints, but exposing a port is the operator's choice).

    Raises:
        ConfigError: the port is out of range or cannot be bound (the message names --metrics-port).
    """
    from prometheus_client import disable_created_metrics, start_http_server

    disable_created_metrics()  # type: ignore[no-untyped-call]  # this process is kvcr's own: no `_created` series beside every counter
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be 0..65535, got {port}")
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return MetricsServer(host, int(server.server_port), server, thread)
