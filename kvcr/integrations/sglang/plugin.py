"""The SGLang plugin that forwards request hints to kvcr (entry point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`load` in every scheduler process; it registers three
hooks (see ``hints_bridge``):

* around ``Scheduler._prefetch_kvcache(req, ...)``: remember ``req.kv_hints`` under ``req.rid``;
* around the cache controllers' ``_storage_hit_query(operation)`` and ``_page_transfer(operation)``:
  make that request's hint current on the prefetch thread while the backend is called.

A hint is advisory: a request without one, or a malformed one, is served from local DRAM only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvcr.integrations.sglang import hints_bridge

log = logging.getLogger(__name__)

_CONTROLLERS = (
    "sglang.srt.managers.cache_controller.HiCacheController",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController",
)
_loaded = False


def _record_request_hint(original: Callable[..., Any], scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    hints = getattr(req, "kv_hints", None)
    if hints is not None:
        hints_bridge.remember(str(req.rid), _builtins(hints))
    return original(scheduler, req, *args, **kwargs)


def _with_request_hint(original: Callable[..., Any], controller: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    with hints_bridge.active(getattr(operation, "request_id", None)):
        return original(controller, operation, *args, **kwargs)


def _builtins(hints: Any) -> Any:
    if isinstance(hints, (dict, str, bytes)):
        return hints
    import msgspec

    return msgspec.to_builtins(hints)


def load() -> None:
    """Register the hooks (idempotent); SGLang applies them right after loading plugins."""
    global _loaded
    if _loaded:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", _record_request_hint, HookType.AROUND
    )
    for controller in _CONTROLLERS:
        for method in ("_storage_hit_query", "_page_transfer"):
            HookRegistry.register(f"{controller}.{method}", _with_request_hint, HookType.AROUND)
    _loaded = True
    log.info("kvcr: request hints are forwarded to the HiCache storage backend")
