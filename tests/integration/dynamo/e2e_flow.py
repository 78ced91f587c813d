"""Run in a fresh process by test_end_to_end.py (the SGLang plugin's hooks patch SGLang globally).

Replica A: SGLang's real HybridCacheController with kvcr as its storage backend, publishing its
kvcr DRAM residency as KV events; A backs a prompt up through ``write_storage``, so kvcr's
plugin captures the page tokens on SGLang's backup path. Dynamo's SelectionService, fed by
those events, produces the hint for replica B; it travels as B's request ``kv_hints`` through
kvcr's plugin to B's backend, which restores A's pages from A's kvcr DRAM. Prints one
``RESULT {json}`` line.

Usage: ``python -m tests.integration.dynamo.e2e_flow <transport> [without-plugin]`` (transport
``mock`` or ``nixl``). Without the plugin no tokens are captured, so nothing can be indexed.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import tests.integration.sglang.conftest  # noqa: F401  (cache dirs, torchvision stub)

MODEL = "test-model"  # what sg.controller names the model (the namespace must match on A and B)


def main() -> None:
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from kvcr.domain.keys import router_id
    from kvcr.integrations.dynamo import BlockingHintProducer, default_registry, kv_hints_from_request
    from tests.integration.dynamo.conftest import free_port
    from tests.integration.sglang import sg

    transport = sys.argv[1]
    with_plugin = sys.argv[2:] != ["without-plugin"]
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    if with_plugin:
        load_plugins()  # kvcr's entry point: hint forwarding and backup token capture
    result: dict[str, object] = {"transport": transport}

    control_a, control_b = free_port(), free_port()
    events_a, events_b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    host_a, host_b = sg.mha_host("page_first"), sg.mha_host("page_first")
    common: dict[str, Any] = {"transport": transport, "dram_bytes": "4MiB"}
    ctrl_a, _ = sg.controller(host_a, control_port=control_a, kv_events_endpoint=events_a, **common)
    ctrl_b, _ = sg.controller(
        host_b, control_port=control_b, kv_events_endpoint=events_b, enable_remote_hint=True, **common
    )
    a, b = ctrl_a.storage_backend, ctrl_b.storage_backend
    producer = BlockingHintProducer(timeout_s=10.0)
    try:
        for worker, store, events, control in ((1, a, events_a, control_a), (2, b, events_b, control_b)):
            record = producer.register_worker(worker, MODEL, sg.P, events, {0: f"tcp://127.0.0.1:{control}"})
            assert record["lifecycle"] == "schedulable", record
            assert store.kv_events.publisher.wait_for_subscriber(5.0), "the router never subscribed"

        # A backs the prompt up through SGLang's own storage write path.
        tokens = list(range(2000, 2000 + 6 * sg.P))
        keys = get_hash_str(tokens, None, page_size=sg.P)
        src = host_a.alloc(6 * sg.P)
        sg.fill(host_a, src, seed=77)
        ctrl_a.write_storage(src, tokens, hash_value=keys, prefix_keys=None, extra_pools=None)
        done = ctrl_a.ack_backup_queue.get(timeout=30)
        result["backed_up_tokens"] = done.completed_tokens
        result["captured_pages"] = default_registry().stats()["recorded_pages"]
        result["a_holds"] = a.runner.exists("kv", keys)

        deadline = time.monotonic() + (5 if with_plugin else 1)
        seen = 0
        while time.monotonic() < deadline and seen < len(keys):
            seen = producer.overlap_scores(MODEL, tokens).get((1, 0), 0)
            time.sleep(0.02)
        result["router_blocks_on_a"] = seen

        hint = producer.hint_for(MODEL, tokens, target_worker_id=2, request_id="req-e2e")
        payload = hint["actions"][0]["payload"] if hint else {}
        result["hint_source"] = payload.get("source_control_endpoint")
        result["hint_names_a_pages"] = payload.get("block_hashes") == [router_id(k) for k in keys]

        # B: the request's kv_hint reaches the backend as SGLang kv_hints, through kvcr's plugin.
        kv_hints = kv_hints_from_request({"request_id": "req-e2e", "token_ids": tokens, "kv_hint": hint})
        req = SimpleNamespace(rid="req-e2e", kv_hints=decode_kv_hints_envelope(kv_hints) if kv_hints else None)
        Scheduler._prefetch_kvcache(SimpleNamespace(enable_hicache_storage=False, enable_lmcache=False), req)
        op, dst, completed = sg.prefetch(ctrl_b, "req-e2e", tokens)
        result["hit_tokens"] = op.storage_hit_count
        result["bytes_equal"] = False
        if dst is not None:
            result["prefetched_tokens"] = completed
            result["bytes_equal"] = sg.pages_equal(host_a, src, host_b, dst)
        # RELEASE is one-way: A frees the lease when the message arrives, not before B returns.
        release_deadline = time.monotonic() + 5
        while a.runner.active_leases and time.monotonic() < release_deadline:
            time.sleep(0.01)
        result["a_leases_left"] = a.runner.active_leases
        result["b_kv_events"] = b.kv_events.stats()
        result["a_kv_events"] = a.kv_events.stats()
    finally:
        producer.close()
        ctrl_a.detach_storage_backend()
        ctrl_b.detach_storage_backend()
        a.close()
        b.close()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
