"""An SGLang replica for cross-process tests and benchmarks: kvcr as its HiCache backend over NIXL.

``python -m kvcr.testing.sglang_replica --port P --pages N --layers L`` builds SGLang 0.5.23's real
``MHATokenToKVPoolHost`` (the shape of ``kvcr.bench.sglang``), creates ``KvcrHiCacheStorage``
through SGLang's storage factory with transport ``T`` (``--transport``, nixl by default) and control
port ``P``, fills ``N`` pages
from a seeded generator, backs them up with ``batch_set_v1``, prints one ``READY {json}`` line
(port, endpoint, page keys) and serves until stdin closes or it is killed. Another process can
rebuild the same bytes with :func:`expected_pages`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvcr.testing.sglang import LAYER_BYTES, PAGE_TOKENS, backend, host_pool, prepare_environment, storage_config


def page_keys(pages: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    return list(get_hash_str(list(range(7, 7 + pages * PAGE_TOKENS)), None, page_size=PAGE_TOKENS))


def expected_pages(layers: int, pages: int, seed: int) -> Any:
    """The source's page bytes, as int16 (bit patterns: random bf16 includes NaNs)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (2, pages * PAGE_TOKENS, layers, 8, 128)
    return torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transport", default="nixl")
    args = parser.parse_args(argv)
    prepare_environment()
    import torch

    host = host_pool(args.layers, args.pages)
    host.kv_buffer.view(torch.int16).copy_(expected_pages(args.layers, args.pages, args.seed))
    # Twice the pages it holds: a peer may lease at most half of a pool (the owner keeps room to back up).
    # Twice its pages, and no per-peer share below the lease cap: one peer may lease all it holds.
    dram_bytes = 2 * args.pages * args.layers * LAYER_BYTES
    config = storage_config(args.port, dram_bytes=dram_bytes, peer_lease_share=1.0, transport=args.transport)
    store = backend(host, config)
    keys = page_keys(args.pages)
    stored = store.batch_set_v1(keys, torch.arange(args.pages * PAGE_TOKENS, dtype=torch.int64))
    info = {"port": args.port, "endpoint": store.node.endpoint, "stored": sum(stored), "keys": keys}
    print("READY " + json.dumps(info), flush=True)
    try:
        sys.stdin.read()
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
