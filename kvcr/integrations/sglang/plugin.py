"""The SGLang plugin that forwards request hints to kvcr (entry point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`load` in every scheduler process; it registers these
hooks (see ``hints_bridge``):

* around ``Scheduler._prefetch_kvcache(req, ...)``: remember ``req.kv_hints`` under ``req.rid``;
* around the cache controllers' ``_storage_hit_query(operation)`` and ``_page_transfer(operation)``:
  make that request's hint current on the prefetch thread while the backend is called; when the
  outermost ``_page_transfer`` returns, the request's prefetch is over (``prefetch_finished``);
* around ``_sync_prefetch_hit_query(operation, count)``: the hit after SGLang's MIN all-reduce
  across ranks; pages past it will not be read (``prefetch_trimmed``);
* after ``UnifiedRadixCache.revoke_pending_prefetch(request)``: a prefetch dropped before any
  read (``prefetch_finished``). Backends release the leases those pages hold at once.
* around the PD decode side's ``DecodeHiCachePreallocMixin._build_decode_prefix_match(req, ...)``:
  the decode scheduler never calls ``_prefetch_kvcache``; it asks storage for its hit synchronously
  (``query_storage_hit_length``, under SGLang's anonymous ``__storage_hit_query__`` handle, then the
  all-rank MIN), and its prefetch reads that span without a second query. The wrapper remembers the
  request's hint and makes the request current for the call; the hit-query wrapper keeps that
  request instead of the anonymous one, so the leases belong to the request and end with its
  prefetch; after ``_start_hicache_prefetch(req, prefix_match)`` left no L3 span (SGLang declined
  the prefetch: below its threshold, rate limited, or an error), they end at once.

A hint is advisory: a request without one, or a malformed one, is served from local DRAM only.

One more hook captures token ids for kvcr's KV events (see
``kvcr.integrations.shared.page_tokens``): around ``HiCacheController._page_backup(operation)``,
which runs on the backup thread right before the KV pages go to ``batch_set_v1`` and only when
this rank really backs KV up (``HybridCacheController`` reaches it through ``super()``). It
records each page's tokens under ``operation.hash_value``, the keys storage receives. It does
nothing unless a kvcr backend in this process publishes KV events, and it never raises.

In a ``python -m dynamo.sglang`` process (Dynamo's SGLang worker builds ``sgl.Engine`` in-process,
and the engine loads plugins there), :func:`load` also installs ``shared.dynamo_sglang``: the
router hint capability on the worker's registration and ``kv_hints`` forwarding on its request
handlers, both only when the engine's L3 is kvcr with ``enable_remote_hint``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvcr.integrations.sglang import engine_events, hook_points
from kvcr.integrations.shared import dynamo_sglang, hints_bridge
from kvcr.integrations.shared.page_tokens import default_registry

log = logging.getLogger(__name__)

_loaded = False
ANONYMOUS_HIT_QUERY = "__storage_hit_query__"
"""The request id of SGLang's synchronous hit query (``UnifiedRadixCache.query_storage_hit_length``)."""


def _remember_hint(req: Any) -> None:
    hints = getattr(req, "kv_hints", None)
    if hints is not None:
        hints_bridge.remember(str(req.rid), _builtins(hints))


def _record_request_hint(original: Callable[..., Any], scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    _remember_hint(req)
    return original(scheduler, req, *args, **kwargs)


def _decode_match_with_request_hint(
    original: Callable[..., Any], queue: Any, req: Any, *args: Any, **kwargs: Any
) -> Any:
    rid = getattr(req, "rid", None)
    if rid is None:
        return original(queue, req, *args, **kwargs)
    _remember_hint(req)
    with hints_bridge.active(str(rid)):
        return original(queue, req, *args, **kwargs)


def _with_request_hint(original: Callable[..., Any], controller: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    request_id = getattr(operation, "request_id", None)
    if request_id == ANONYMOUS_HIT_QUERY and hints_bridge.current_request() is not None:
        return original(controller, operation, *args, **kwargs)  # the request the caller made current
    with hints_bridge.active(request_id):
        return original(controller, operation, *args, **kwargs)


def _transfer_with_request_hint(
    original: Callable[..., Any], controller: Any, operation: Any, *args: Any, **kwargs: Any
) -> Any:
    request_id = getattr(operation, "request_id", None)
    outermost = hints_bridge.current_request() is None  # the hybrid controller nests super()._page_transfer
    try:
        with hints_bridge.active(request_id):
            return original(controller, operation, *args, **kwargs)
    finally:
        if outermost and request_id is not None:
            _notify(hints_bridge.prefetch_finished, str(request_id))


def _trim_to_synced_hit(
    original: Callable[..., Any], controller: Any, operation: Any, hit_tokens: Any, *args: Any, **kwargs: Any
) -> Any:
    synced = original(controller, operation, hit_tokens, *args, **kwargs)
    request_id = getattr(operation, "request_id", None)
    try:
        pages = int(synced) // int(controller.page_size)
        hashes = list(getattr(operation, "all_hash_values", None) or ())
    except (TypeError, ValueError, AttributeError):
        return synced
    if request_id is not None:
        _notify(hints_bridge.prefetch_trimmed, str(request_id), hashes[:pages])
    return synced


def _finish_declined_decode_prefetch(
    result: Any, queue: Any, req: Any, prefix_match: Any, *args: Any, **kwargs: Any
) -> None:
    del result, queue, args, kwargs  # an AFTER hook: None keeps the original's result
    rid = getattr(req, "rid", None)
    if rid is not None and prefix_match is not None and getattr(prefix_match, "l3_storage_hit_length", 0) <= 0:
        _notify(hints_bridge.prefetch_finished, str(rid))  # no prefetch was issued: nothing reads the leases


def _finish_revoked(result: Any, cache: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    del result, cache, args, kwargs  # an AFTER hook: None keeps the original's result
    rid = getattr(request, "rid", None)
    if rid is not None:
        _notify(hints_bridge.prefetch_finished, str(rid))


def _notify(call: Callable[..., None], *args: Any) -> None:
    try:
        call(*args)
    except Exception:  # releasing early is an optimisation: never cost SGLang its prefetch
        log.warning("kvcr: could not release leases early; they expire on their own", exc_info=True)


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


def _engine_publisher_built(result: Any, events: Any, *args: Any, **kwargs: Any) -> None:
    del result, args, kwargs  # an AFTER hook: None keeps the original's result
    try:
        engine_events.engine_publisher_ready(getattr(events, "kv_event_publisher", None))
    except Exception:  # the router then misses kvcr's tier; SGLang's own events are untouched
        log.warning("kvcr: could not reach SGLang's KV-event publisher; kvcr's tier stays unpublished", exc_info=True)


def _builtins(hints: Any) -> Any:
    if isinstance(hints, (dict, str, bytes)):
        return hints
    import msgspec

    return msgspec.to_builtins(hints)


def _install_dynamo_host_hooks() -> None:
    try:
        dynamo_sglang.install()
    except Exception:  # Dynamo's worker must start whatever its code looks like
        log.warning("kvcr: could not hook dynamo.sglang; it publishes no hint capability", exc_info=True)


_WRAPPERS: dict[str, tuple[Callable[..., Any], str]] = {
    "_prefetch_kvcache": (_record_request_hint, "AROUND"),
    "_build_decode_prefix_match": (_decode_match_with_request_hint, "AROUND"),
    "_start_hicache_prefetch": (_finish_declined_decode_prefetch, "AFTER"),
    "_storage_hit_query": (_with_request_hint, "AROUND"),
    "_page_transfer": (_transfer_with_request_hint, "AROUND"),
    "_sync_prefetch_hit_query": (_trim_to_synced_hit, "AROUND"),
    "revoke_pending_prefetch": (_finish_revoked, "AFTER"),
    "_page_backup": (_capture_backup_tokens, "AROUND"),
    "init_kv_events": (_engine_publisher_built, "AFTER"),
}
"""kvcr's wrapper for each hooked method, and how SGLang's registry applies it."""


_HOOK_SETS: tuple[tuple[tuple[hook_points.HookPoint, ...], str], ...] = (
    (
        hook_points.HINT_POINTS,
        "request hints are OFF: this SGLang's hook points are not what kvcr's plugin wraps; the backend still "
        "serves its local pages (kvcr doctor shows the same)",
    ),
    (
        hook_points.TOKEN_POINTS,
        "backed-up pages get no KV events: this SGLang's hook point is not what kvcr's plugin wraps",
    ),
    (
        hook_points.STREAM_POINTS,
        "the router cannot see kvcr's tier: this SGLang's KV-event publisher is not where kvcr's plugin finds "
        "it; set kv_events_endpoint to publish on a socket of kvcr's own",
    ),
)
"""Each set of hooks, registered whole or not at all, and what is off without it (logged with why)."""


def _register(registry: Any, hook_type: Any, points: tuple[hook_points.HookPoint, ...]) -> None:
    for point in points:
        wrapper, kind = _WRAPPERS[point.target.rsplit(".", 1)[1]]
        registry.register(point.target, wrapper, getattr(hook_type, kind))


def load() -> None:
    """Register the hooks (idempotent); SGLang applies them right after loading plugins."""
    global _loaded
    if _loaded:
        return
    from kvcr import compat

    try:
        compat.ensure_supported("sglang")
    except compat.IncompatibleEnvironment as exc:
        log.error("%s; kvcr's plugin stays off", exc)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing: list[str] = []
    for points, without in _HOOK_SETS:
        problems = hook_points.problems(points)
        if problems:
            log.error("kvcr: %s: %s", without, "; ".join(problems))
        else:
            _register(HookRegistry, HookType, points)
        missing += problems
    hook_points.record(missing)
    _loaded = True
    _install_dynamo_host_hooks()
    if not missing:
        log.info("kvcr: request hints are forwarded to the HiCache storage backend; backed-up page tokens are captured")
