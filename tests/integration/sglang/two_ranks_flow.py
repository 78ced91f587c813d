"""One TP rank of two, run in its own process by test_two_ranks.py.

Each rank has SGLang's real host pool and HybridCacheController over a gloo world of two, with
kvcr as its storage backend, so hit queries and prefetch completions go through SGLang's own
rank collectives (``_sync_prefetch_hit_query``'s MIN all-reduce and the completion sync), as
they do under a TP-2 scheduler. Every round backs up ``pages[rank]`` pages of a fresh prompt on
this rank, waits for the other rank, prefetches the whole prompt and reports what it got.
With ``peer`` set, each rank's pages sit instead on a peer replica of the same rank (its kvcr in
this process, dialled at the hint's base port + rank), the request carries a hint naming that
peer, and the rank named ``dead_peer_rank`` finds its peer closed. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import tests.integration.sglang.conftest  # noqa: F401  (cache dirs, torchvision stub)


def main() -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from tests.integration.sglang import sg

    spec = json.loads(sys.argv[1])
    rank: int = spec["rank"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['init_port']}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1)
    attn_tp_group = None
    if spec.get("dp_attention"):
        # DP attention 2 x 1 as initialize_dp_attention leaves it: TP 2 split into two attention-DP
        # ranks with an attention-TP group of one each (every rank creates every group)
        from sglang.srt.runtime_context import get_flags

        get_flags().dp.enabled = True
        get_parallel().override_permanently(attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=rank, attn_dp_size=2)
        attn_tp_group = [dist.new_group([0]), dist.new_group([1])][rank]
    host = sg.mha_host("page_first")
    peer = spec.get("peer")
    settings = {"enable_remote_hint": True} if peer else {}
    ctrl, group = sg.controller(
        host, tp_group=dist.group.WORLD, attn_tp_group=attn_tp_group, control_port=spec["control_port"], **settings
    )
    replica: Any = None
    peer_host: Any = None
    if peer:
        load_plugins()
        peer_host = sg.mha_host("page_first")
        replica = _peer_replica(peer["port"], rank, peer_host, dead=spec.get("dead_peer_rank") == rank)
    held = spec["pages"][rank]
    rounds = []
    try:
        for round_no in range(spec["rounds"]):
            tokens = list(range(10_000 * (round_no + 1), 10_000 * (round_no + 1) + spec["prompt_pages"] * sg.P))
            hashes = get_hash_str(tokens, None, page_size=sg.P)
            rid = f"r{round_no}"
            if peer:  # the pages live on this rank's peer replica, in its own host pool
                src_host, src = peer_host, peer_host.alloc(held * sg.P)
            else:
                src_host, src = host, group.alloc(held * sg.P)
            sg.fill(src_host, src, seed=100 * round_no + rank)  # TP shards differ, so must the bytes
            if peer:
                backed_up = _peer_holds(replica, src, hashes[:held])
                _hint(rid, peer["port"], hashes)
            else:
                ctrl.write_storage(src, tokens[: held * sg.P], hash_value=hashes[:held], prefix_keys=None)
                backed_up = ctrl.ack_backup_queue.get(timeout=30).completed_tokens
            dist.barrier()  # both ranks' backups are done before either queries
            op, dst, completed = sg.prefetch(ctrl, rid, tokens, timeout=30)
            pages = completed // sg.P
            bytes_ok = pages == 0 or sg.pages_equal(src_host, src[: pages * sg.P], host, dst[: pages * sg.P])
            hit = op.storage_hit_count
            outcome = {"backed_up": backed_up, "hit": hit, "completed": completed, "bytes_ok": bytes_ok}
            if replica is not None:
                outcome["peer_leases"] = replica.runner.active_leases  # what the prefetch left pinned there
            rounds.append(outcome)
            if peer:
                peer_host.free(src)
            else:
                group.free(src)
            if dst is not None:
                group.free(dst)
            dist.barrier()
    finally:
        ctrl.detach_storage_backend()
        if replica is not None:
            replica.close()
        dist.destroy_process_group()
    identity = {
        "tp_rank": ctrl.storage_config.tp_rank,
        "tp_size": ctrl.storage_config.tp_size,
        "dp_rank": ctrl.storage_config.dp_rank,
    }
    print(
        "RESULT " + json.dumps({"rank": rank, "rounds": rounds, "storage": identity, "torch": torch.__version__}),
        flush=True,
    )


def _peer_replica(port: int, rank: int, host: Any, *, dead: bool) -> Any | None:
    """A peer replica of this rank (its kvcr in this process); a ``dead`` one is closed at once
    (None), so the hint names a control port nobody serves any more."""
    from kvcr.integrations.sglang import KvcrHiCacheStorage
    from tests.integration.sglang import sg

    replica = KvcrHiCacheStorage(sg.storage_config(tp_rank=rank, tp_size=2, control_port=port), {})
    replica.register_mem_pool_host(host)
    replica.register_mem_host_pool_v2(host, "kv")
    replica.on_host_pools_registered()
    if dead:
        replica.close()
        return None
    return replica


def _peer_holds(replica: Any, src: Any, hashes: list[str]) -> int:
    """Back ``src``'s pages up on the peer replica; the tokens it took (none for a closed one)."""
    from tests.integration.sglang import sg

    if replica is None:
        return 0
    stored = replica.batch_set_v1(hashes, src)
    assert stored == [True] * len(hashes), stored
    return len(hashes) * sg.P


def _hint(rid: str, port: int, hashes: list[str]) -> None:
    """Attach a router hint naming the peer to request ``rid``, through the scheduler's own entry point."""
    from types import SimpleNamespace

    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
    from sglang.srt.managers.scheduler import Scheduler

    from kvcr.domain.keys import router_id

    action = {
        "action_id": "a1",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": {
            "source_control_endpoint": f"tcp://127.0.0.1:{port}",
            "block_hashes": [router_id(k) for k in hashes],
        },
    }
    envelope = {"protocol_version": "0.1", "message_id": rid, "actions": [action]}
    req = SimpleNamespace(rid=rid, kv_hints=decode_kv_hints_envelope(envelope))
    Scheduler._prefetch_kvcache(SimpleNamespace(enable_hicache_storage=False, enable_lmcache=False), req)


if __name__ == "__main__":
    main()
