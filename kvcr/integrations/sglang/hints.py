"""A request's hint as the SGLang backend sees it: found, parsed, vetted, turned into sources.

The hint comes from ``extra_info.extra_info["kv_hints"]`` (what newer SGLang passes), the legacy
``kvcr_router_hint`` key, or the plugin's bridge (SGLang 0.5.23). Parsing fails closed (local
only); a source outside ``peer_allowlist`` is refused. Rejections are counted by a closed set of
reasons, never by their text (which carries whatever the request sent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from kvcr.domain.hints import FetchHint, Rejection, parse_hint
from kvcr.integrations.shared import hints_bridge
from kvcr.integrations.shared.settings import KvcrSettings
from kvcr.ports.metric_catalogue import MetricName
from kvcr.ports.metrics import Metrics

log = logging.getLogger(__name__)

HINT_KEYS = ("kv_hints", "kvcr_router_hint")
_LOG_EVERY_S = 10.0


class HintReader:
    """Finds, parses and vets the hint of the request being served. Thread-safe."""

    def __init__(self, settings: KvcrSettings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._lock = threading.Lock()
        self._rejected: dict[Rejection, int] = {}
        self._last_log = 0.0

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected hints by reason (a closed set)."""
        with self._lock:
            return {code.value: count for code, count in self._rejected.items()}

    def read(self, extra_info: Any) -> FetchHint | None:
        """The usable hint of this call, or None (local only)."""
        raw = _raw_hint(extra_info)
        if raw is None:
            return None
        parsed = parse_hint(raw)
        hint = parsed.hint
        if hint is None:
            self._reject(parsed.code or Rejection.UNREADABLE, parsed.reason or "unusable")
            return None
        allowed = hint.keeping(tuple(h for h in hint.holders if self._settings.allows(h.source.host)))
        if allowed is None:
            self._reject(Rejection.NOT_ALLOWED, "source is not in peer_allowlist")
        return allowed

    def _reject(self, code: Rejection, reason: str) -> None:
        with self._lock:
            self._rejected[code] = self._rejected.get(code, 0) + 1
            now = time.monotonic()
            quiet = now - self._last_log < _LOG_EVERY_S
            if not quiet:
                self._last_log = now
        self._metrics.increment(MetricName.HINTS_REJECTED, labels={"reason": code})
        if not quiet:  # hints come from requests: at most one line per interval
            log.info("kvcr: ignoring a hint (%s); serving from local DRAM only", reason)


def _raw_hint(extra_info: Any) -> Any:
    inner = getattr(extra_info, "extra_info", None)
    if isinstance(inner, Mapping):
        for key in HINT_KEYS:
            if key in inner:
                raw = inner[key]
                return {key: raw} if key == "kvcr_router_hint" else _builtins(raw)
    return _builtins(hints_bridge.current())


def _builtins(raw: Any) -> Any:
    if raw is None or isinstance(raw, (Mapping, str, bytes, bytearray)):
        return raw
    try:
        import msgspec

        return msgspec.to_builtins(raw)
    except (ImportError, TypeError):
        return None
