"""One TP rank of two, run in its own process by test_two_ranks.py.

Each rank has SGLang's real host pool and HybridCacheController over a gloo world of two, with
kvcr as its storage backend, so hit queries and prefetch completions go through SGLang's own
rank collectives (``_sync_prefetch_hit_query``'s MIN all-reduce and the completion sync), as
they do under a TP-2 scheduler. Every round backs up ``pages[rank]`` pages of a fresh prompt on
this rank, waits for the other rank, prefetches the whole prompt and reports what it got.
Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import tests.integration.sglang.conftest  # noqa: F401  (cache dirs, torchvision stub)


def main() -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.utils import get_hash_str
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
    host = sg.mha_host("page_first")
    ctrl, group = sg.controller(host, tp_group=dist.group.WORLD, control_port=spec["control_port"])
    held = spec["pages"][rank]
    rounds = []
    try:
        for round_no in range(spec["rounds"]):
            tokens = list(range(10_000 * (round_no + 1), 10_000 * (round_no + 1) + spec["prompt_pages"] * sg.P))
            hashes = get_hash_str(tokens, None, page_size=sg.P)
            src = group.alloc(held * sg.P)
            sg.fill(host, src, seed=100 * round_no + rank)  # TP shards differ, so must the bytes
            ctrl.write_storage(src, tokens[: held * sg.P], hash_value=hashes[:held], prefix_keys=None)
            backed_up = ctrl.ack_backup_queue.get(timeout=30).completed_tokens
            dist.barrier()  # both ranks' backups are done before either queries
            op, dst, completed = sg.prefetch(ctrl, f"r{round_no}", tokens, timeout=30)
            pages = completed // sg.P
            bytes_ok = pages == 0 or sg.pages_equal(host, src[: pages * sg.P], host, dst[: pages * sg.P])
            rounds.append(
                {"backed_up": backed_up, "hit": op.storage_hit_count, "completed": completed, "bytes_ok": bytes_ok}
            )
            group.free(src)
            if dst is not None:
                group.free(dst)
            dist.barrier()
    finally:
        ctrl.detach_storage_backend()
        dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "rounds": rounds, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
