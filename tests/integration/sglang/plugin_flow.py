"""Run in a fresh process by test_plugin.py: SGLang's real load_plugins() finds kvcr's entry point,
and a hint set on a request reaches the backend through the real cache controller."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import tests.integration.sglang.conftest  # noqa: F401  (cache dirs, torchvision stub)


def main() -> None:
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from kvcr.domain.keys import router_id
    from kvcr.integrations.sglang import KvcrHiCacheStorage
    from tests.integration.sglang import sg

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    use_plugin = sys.argv[1] != "without-plugin"
    if sys.argv[1] == "moved-hook":
        # Another SGLang release, as this process sees it: a hooked method whose parameters changed.
        from sglang.srt.managers.cache_controller import HiCacheController

        original = HiCacheController._page_transfer

        def _page_transfer(self, prefetch_op):
            return original(self, prefetch_op)

        HiCacheController._page_transfer = _page_transfer
    if use_plugin:
        load_plugins()

    # Replica A holds the prefix in its kvcr DRAM.
    port_a, port_b = sg.free_port(), sg.free_port()
    host_a = sg.mha_host("page_first")
    a = KvcrHiCacheStorage(sg.storage_config(control_port=port_a), {})
    a.register_mem_pool_host(host_a)
    a.register_mem_host_pool_v2(host_a, "kv")
    a.on_host_pools_registered()
    tokens = list(range(900, 900 + 4 * sg.P))
    keys = get_hash_str(tokens, None, page_size=sg.P)
    src = host_a.alloc(4 * sg.P)
    sg.fill(host_a, src, seed=41)
    assert a.batch_set_v1(keys, src) == [True] * 4

    # Replica B: SGLang's real controller with kvcr as its storage backend, hints enabled.
    host_b = sg.mha_host("page_first")
    ctrl, _ = sg.controller(host_b, control_port=port_b, enable_remote_hint=True)
    envelope = {
        "protocol_version": "0.1",
        "message_id": "req-7",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": f"tcp://127.0.0.1:{port_a}",
                    "block_hashes": [router_id(k) for k in keys],
                },
            }
        ],
    }
    if sys.argv[1] in ("decode", "decode-declined"):
        declined = sys.argv[1] == "decode-declined"
        _decode_side(a, host_a, src, ctrl, host_b, tokens, decode_kv_hints_envelope(envelope), declined)
        return
    req = SimpleNamespace(rid="req-7", kv_hints=decode_kv_hints_envelope(envelope))
    # The scheduler's entry point to storage prefetch (storage disabled on this stub: the hook
    # sees the request, the body returns at once).
    Scheduler._prefetch_kvcache(SimpleNamespace(enable_hicache_storage=False, enable_lmcache=False), req)
    if sys.argv[1] == "revoked":
        # The hit query leases A's pages; the scheduler then revokes the prefetch before any read.
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        handle = CacheRequestHandle(rid="req-7", attempt_id=0)
        op = ctrl.prefetch(handle, tokens, None, None)
        assert ctrl.prefetch_hit_queue.get(timeout=20) is op
        held = a.runner.active_leases
        cache = SimpleNamespace(_finish_storage_prefetch=lambda *args, **kwargs: None, ongoing_prefetch={})
        UnifiedRadixCache.revoke_pending_prefetch(cache, handle)
        result = {"hit_tokens": op.storage_hit_count, "leases_after_query": held, "leases": a.runner.active_leases}
        ctrl.detach_storage_backend()
        a.close()
        print("RESULT " + json.dumps(result))
        return
    op, dst, completed = sg.prefetch(ctrl, "req-7", tokens, timeout=20)
    from kvcr.integrations.sglang import hook_points

    result = {
        "hit_tokens": op.storage_hit_count,
        "bytes_equal": False,
        "leases": a.runner.active_leases,
        "missing": list(hook_points.missing_at_load()),
        "gauge": ctrl.storage_backend._ready().metrics.snapshot().get("kvcr_hint_hooks_missing"),
        "doctor": _doctor_says(),
    }
    if dst is not None:
        result["prefetched_tokens"] = completed
        result["bytes_equal"] = sg.pages_equal(host_a, src, host_b, dst)
    ctrl.detach_storage_backend()
    a.close()
    print("RESULT " + json.dumps(result))


def _decode_side(
    a: Any, host_a: Any, src: Any, ctrl: Any, host_b: Any, tokens: list[int], hints: Any, declined: bool
) -> None:
    """PD decode as SGLang 0.5.23 runs it: the prealloc queue's ``_build_decode_prefix_match`` asks
    ``UnifiedRadixCache.query_storage_hit_length`` (a synchronous hit query under SGLang's anonymous
    ``__storage_hit_query__`` handle, then the all-rank MIN), and the prefetch that follows reads that
    span with ``assume_stored`` (no second query) once ``_start_hicache_prefetch`` admits it, or
    nothing at all when the tree declines it (``declined``). SGLang's real methods run on stand-ins
    for the queue and the tree (one rank, nothing on the device, the root as the anchor)."""
    from sglang.srt.disaggregation.decode_hicache_mixin import DecodeHiCachePreallocMixin
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from tests.integration.sglang import sg

    tree = SimpleNamespace(
        enable_storage=True,
        cache_controller=ctrl,
        page_size=sg.P,
        prefetch_threshold=sg.P,
        tree_core=SimpleNamespace(is_eagle=False),
        hicache_storage_pass_prefix_keys=False,
        _all_reduce_attn_groups=lambda tensor, op: None,  # one rank: the MIN of one
        prefix_device_indices=lambda req: [],
        is_backuped=lambda node: False,
        is_root=lambda node: True,
        get_last_hash_value=lambda node: None,
    )
    tree.query_storage_hit_length = lambda *args, **kwargs: UnifiedRadixCache.query_storage_hit_length(
        tree, *args, **kwargs
    )
    started: list[Any] = []

    def prefetch_from_storage(
        handle: Any, node: Any, new_tokens: list[int], last_hash: Any, *args: Any, **kw: Any
    ) -> Any:
        if declined:  # below the threshold or rate limited: SGLang's tree issues nothing
            return None
        started.append(ctrl.prefetch(handle, new_tokens, last_hash, None, assume_stored=True))
        return True

    tree.prefetch_from_storage = prefetch_from_storage
    tree.has_ongoing_prefetch = lambda handle: bool(started)
    queue = SimpleNamespace(tree_cache=tree, scheduler=SimpleNamespace(enable_decode_hicache=True))
    req = SimpleNamespace(
        rid="req-d",
        kv_hints=hints,
        origin_input_ids=tokens,
        extra_key=None,
        cache_salt=None,
        cache_request_handle=CacheRequestHandle(rid="req-d", attempt_id=0),
    )
    matched = SimpleNamespace(host_hit_length=0, last_host_node="root", last_device_node="root")
    match = DecodeHiCachePreallocMixin._build_decode_prefix_match(queue, req, matched)
    result: dict[str, Any] = {"hit_tokens": match.l3_storage_hit_length, "leases_after_query": a.runner.active_leases}
    DecodeHiCachePreallocMixin._start_hicache_prefetch(queue, req, match)  # after admission
    result["hit_after_start"] = match.l3_storage_hit_length
    if started:
        _, dst, completed = sg.finish_prefetch(ctrl, started[0], timeout=20)
        result["prefetched_tokens"] = completed
        result["bytes_equal"] = dst is not None and sg.pages_equal(host_a, src, host_b, dst)
    result["leases"] = a.runner.active_leases
    ctrl.detach_storage_backend()
    a.close()
    print("RESULT " + json.dumps(result))


def _doctor_says() -> list[str]:
    """What ``kvcr doctor``'s SGLang check answers in this process (as the SGLang it sees is)."""
    from kvcr.doctor import check_sglang_version

    finding = check_sglang_version()
    return [finding.status.value, finding.detail]


if __name__ == "__main__":
    main()
