"""The private SGLang methods kvcr's plugin wraps, and the check that each is where kvcr expects it.

The plugin's wrappers call these methods with the leading arguments named here. SGLang can move or
change them in any release; SGLang's hook registry then only logs that it could not apply a hook,
and request hints would be lost without a sound. So the plugin checks every point before it
registers anything: when one hint point is missing or its leading parameters differ, no hint hook
is registered, one ERROR line says which and why, ``kvcr_hint_hooks_missing`` counts them, and
``kvcr doctor`` fails; the backend keeps serving its local pages. The KV-event token capture has
its own point and is checked on its own. ``KVCR_ALLOW_UNSUPPORTED=1`` skips the version check,
never this one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

_CONTROLLERS = (
    "sglang.srt.managers.cache_controller.HiCacheController",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController",
)


@dataclass(frozen=True, slots=True)
class HookPoint:
    """A method as ``module.Class.method`` and the leading parameters the wrapper passes it."""

    target: str
    params: tuple[str, ...]


HINT_POINTS: tuple[HookPoint, ...] = (
    HookPoint("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", ("self", "req")),
    HookPoint(
        "sglang.srt.disaggregation.decode_hicache_mixin.DecodeHiCachePreallocMixin._build_decode_prefix_match",
        ("self", "req"),
    ),
    HookPoint(
        "sglang.srt.disaggregation.decode_hicache_mixin.DecodeHiCachePreallocMixin._start_hicache_prefetch",
        ("self", "req", "prefix_match"),
    ),
    *(HookPoint(f"{c}._storage_hit_query", ("self", "operation")) for c in _CONTROLLERS),
    *(HookPoint(f"{c}._page_transfer", ("self", "operation")) for c in _CONTROLLERS),
    *(HookPoint(f"{c}._sync_prefetch_hit_query", ("self", "operation", "storage_hit_count")) for c in _CONTROLLERS),
    HookPoint(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.revoke_pending_prefetch", ("self", "request")
    ),
)
"""What request hints need, all of them: remember the hint, make it current, learn the trimmed hit, end it."""

TOKEN_POINTS: tuple[HookPoint, ...] = (
    HookPoint("sglang.srt.managers.cache_controller.HiCacheController._page_backup", ("self", "operation")),
)
"""What KV events need: a backup's page tokens."""

STREAM_POINTS: tuple[HookPoint, ...] = (
    HookPoint(
        "sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher.init_kv_events",
        ("self", "kv_events_config"),
    ),
)
"""What puts kvcr's residency on SGLang's own KV-event stream: the scheduler's publisher, once built."""


def problems(points: Sequence[HookPoint]) -> list[str]:
    """One line per point that cannot be found or whose leading parameters are not the expected ones."""
    found = []
    for point in points:
        why = _problem(point)
        if why is not None:
            found.append(f"{point.target}: {why}")
    return found


def _problem(point: HookPoint) -> str | None:
    module_name, class_name, method_name = point.target.rsplit(".", 2)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure of SGLang's module is the finding
        return f"its module does not import ({type(exc).__name__}: {exc})"
    owner = getattr(module, class_name, None)
    if owner is None:
        return f"{module_name} has no {class_name}"
    method = inspect.getattr_static(owner, method_name, None)
    if method is None or not callable(method):
        return f"{class_name} has no method {method_name}"
    try:
        leading = tuple(inspect.signature(method).parameters)[: len(point.params)]
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    if leading != point.params:
        return f"takes ({', '.join(leading)}, ...), kvcr's hook passes ({', '.join(point.params)}, ...)"
    return None


_missing_at_load: tuple[str, ...] = ()


def record(found: Sequence[str]) -> None:
    """What the plugin found missing when it loaded in this process (start-up reports it as a gauge)."""
    global _missing_at_load
    _missing_at_load = tuple(found)


def missing_at_load() -> tuple[str, ...]:
    return _missing_at_load
