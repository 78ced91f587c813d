"""``kvcr demo``: one replica's local tier end to end, on real memory.

It hashes a prompt into SGLang page keys, backs the pages up from a host pool into kvcr DRAM,
evicts under pressure, answers a hit query and restores the surviving prefix into other host
slots, checking every byte.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from kvcr.adapters.local import MmapHostMemory
from kvcr.container import build_container
from kvcr.domain.keys import NamespaceSpec, page_hashes
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.runner import RunnerConfig

PAGE_TOKENS = 64
PIECE = 256 * 1024  # one K or V piece: 64 tokens x 32 layers x 8 heads x 128 dims x 2 bytes / 16


def run_demo(verbose: bool = True, peer: bool = True) -> int:
    def say(text: str) -> None:
        if verbose:
            print(text)

    pool = PoolSpec("kv", (ComponentSpec("k", PIECE), ComponentSpec("v", PIECE)), anchor=True)
    config = RunnerConfig(
        "demo",
        NamespaceSpec("demo-llama", PAGE_TOKENS, "bfloat16", "page_first"),
        (pool,),
        dram_bytes=24 * pool.page_bytes,
    )
    container = build_container(config)
    runner = container.runner()
    memory = container.memory()
    host_pages = 64
    host = memory.allocate(host_pages * pool.page_bytes, "demo/host")
    try:
        regions = [
            RegionDescriptor("k", host.address, PIECE, host_pages, PIECE),
            RegionDescriptor("v", host.address + host_pages * PIECE, PIECE, host_pages, PIECE),
        ]
        runner.register_host_pool("kv", regions)
        ctypes.memmove(host.address, os.urandom(host.nbytes), host.nbytes)
        say(f"runner {config.name!r}, namespace {runner.namespace}, {24} slots of {pool.page_bytes >> 10} KiB")

        prompt_a = list(range(16 * PAGE_TOKENS))
        prompt_b = list(range(50_000, 50_000 + 16 * PAGE_TOKENS))
        keys_a = page_hashes(prompt_a, PAGE_TOKENS)
        keys_b = page_hashes(prompt_b, PAGE_TOKENS)
        stored_a = runner.backup("kv", keys_a, list(range(16)))
        stored_b = runner.backup("kv", keys_b, list(range(16, 32)))
        say(f"backed up prompt A: {sum(stored_a)}/16 pages; prompt B: {sum(stored_b)}/16 pages (24 slots)")
        hit_a, hit_b = runner.query("kv", keys_a), runner.query("kv", keys_b)
        say(f"hit query: A keeps a prefix of {hit_a.prefix} pages, B {hit_b.prefix} (A lost its tail, not its root)")

        outcomes = runner.restore("kv", keys_a[: hit_a.prefix], list(range(32, 32 + hit_a.prefix)))
        same = all(
            ctypes.string_at(r.address(i), PIECE) == ctypes.string_at(r.address(32 + i), PIECE)
            for r in regions
            for i in range(hit_a.prefix)
        )
        say(f"restored {sum(o.restored for o in outcomes)} pages of A into other host slots; bytes equal: {same}")
        stats = runner.stats()
        say(f"stats: {stats.pools[0]}")
        local_ok = same and hit_a.prefix == 8 and hit_b.prefix == 16
    finally:
        runner.close()
        memory.free(host)
    return 0 if local_ok and (not peer or run_peer_demo(say)) else 1


def run_peer_demo(say: Callable[[str], None], port: int | None = None) -> bool:
    """A second replica (another process) serves its pages; this one leases and reads them over NIXL."""
    from kvcr.bench.remote import source_replica
    from kvcr.runner.peer_client import PoolRead
    from kvcr.testing.ports import free_port_block
    from kvcr.testing.replica import HostPool, bench_pool, build_node, page_pattern

    page_bytes = 2 * PIECE
    port = port or free_port_block(2)
    with source_replica(page_bytes, port) as info:
        say(f"replica A (another process) serves {info['stored']} pages at {info['endpoint']}")
        node = build_node(f"demo-replica-b-{port}", port + 1, page_bytes, 4)
        memory = MmapHostMemory()
        host = HostPool.allocate(memory, bench_pool(page_bytes), 16)
        try:
            node.register_host_pool("kv", host.regions)
            keys = info["keys"][:16]
            result = node.client.restore(info["endpoint"], [PoolRead("kv", keys, list(range(16)))])
            restored = sum(o.restored for o in result["kv"])
            same = all(host.read(i) == page_pattern(k, page_bytes) for i, k in enumerate(keys))
            say(f"replica B leased and read {restored}/16 pages over NIXL into its host pool; bytes equal: {same}")
            return restored == 16 and same
        finally:
            node.close()
            host.free()
