"""The SGLang plugin that forwards request hints to kvcr (entry point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`load` in every scheduler process; it registers these
hooks (see ``hints_bridge``):

* around ``Scheduler._prefetch_kvcache(req, ...)``: remember ``req.kv_hints`` under ``req.rid``;
* around the cache controllers' ``_storage_hit_query(operation)`` and ``_page_transfer(operation)``:
  make that request's hint current on the prefetch thread while the backend is called.

A hint is advisory: a request without one, or a malformed one, is served from local DRAM only.

One more hook captures token ids for kvcr's KV events (see
``kvcr.integrations.dynamo.page_tokens``): around ``HiCacheController._page_backup(operation)``,
which runs on the backup thread right before the KV pages go to ``batch_set_v1`` and only when
this rank really backs KV up (``HybridCacheController`` reaches it through ``super()``). It
records each page's tokens under ``operation.hash_value``, the keys storage receives. It does
nothing unless a kvcr backend in this process publishes KV events, and it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvcr.integrations.dynamo.page_tokens import default_registry
from kvcr.integrations.sglang import hints_bridge

log = logging.getLogger(__name__)

_CONTROLLERS = (
    "sglang.srt.managers.cache_controller.HiCacheController",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController",
)
_BACKUP = "sglang.srt.managers.cache_controller.HiCacheController._page_backup"
_loaded = False


def _record_request_hint(original: Callable[..., Any], scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    hints = getattr(req, "kv_hints", None)
    if hints is not None:
        hints_bridge.remember(str(req.rid), _builtins(hints))
    return original(scheduler, req, *args, **kwargs)


def _with_request_hint(original: Callable[..., Any], controller: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    with hints_bridge.active(getattr(operation, "request_id", None)):
        return original(controller, operation, *args, **kwargs)


def _capture_backup_tokens(
    original: Callable[..., Any], controller: Any, operation: Any, *args: Any, **kwargs: Any
) -> Any:
    registry = default_registry()
    if registry.enabled:
        try:
            prefix = getattr(operation, "prefix_keys", None)
            registry.record(
                list(operation.hash_value or ()),
                operation.token_ids,
                int(controller.page_size),
                prior_hash=str(prefix[-1]) if prefix else None,
            )
        except Exception:  # advisory data: a surprise here must never cost SGLang its backup
            log.warning("kvcr: could not capture the token ids of a backup; its pages get no KV events", exc_info=True)
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
    HookRegistry.register(_BACKUP, _capture_backup_tokens, HookType.AROUND)
    _loaded = True
    log.info("kvcr: request hints are forwarded to the HiCache storage backend; backed-up page tokens are captured")
