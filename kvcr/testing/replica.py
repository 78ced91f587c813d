"""A replica for peer tests and benchmarks: a runner node over NIXL (or UCX) + ZMQ holding known pages.

``python -m kvcr.testing.replica --port P --pages N --page-bytes B`` builds a node, fills a host pool
with pages whose bytes are a function of their page hash (``page_pattern``), backs them up,
prints one ``READY {json}`` line (endpoint, namespace, page hashes) and serves until stdin closes
or it is killed. Another process builds the same pool geometry (``bench_pool``) to share the
namespace, and can check every restored byte against ``page_pattern``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcr.adapters.local import MmapHostMemory
from kvcr.container import build_container
from kvcr.domain.deadlines import Timing
from kvcr.domain.keys import NamespaceSpec, page_hashes
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.ports.memory import Allocation, HostMemory
from kvcr.runner.config import RunnerConfig
from kvcr.runner.node import NodeSettings, RunnerNode
from kvcr.runner.peer_client import PeerSettings

PAGE_TOKENS = 64


def bench_pool(page_bytes: int) -> PoolSpec:
    """An MHA-like KV pool: every page is a K piece and a V piece of half the page each."""
    half = page_bytes // 2
    return PoolSpec("kv", (ComponentSpec("k", half), ComponentSpec("v", page_bytes - half)), anchor=True)


def bench_keys(pages: int, start: int = 0) -> list[str]:
    """Page hashes of a synthetic prompt (the same on every process)."""
    return page_hashes(list(range(start, start + pages * PAGE_TOKENS)), PAGE_TOKENS)


def page_pattern(page_hash: str, nbytes: int) -> bytes:
    """The bytes of a page in these tests: its hash's digest repeated (cheap, and distinct per page)."""
    block = hashlib.sha256(page_hash.encode()).digest() * 128  # 4 KiB
    return (block * (nbytes // len(block) + 1))[:nbytes]


@dataclass
class HostPool:
    """A host pool of ``pages`` pages in memory from HostMemory, one dense region per component."""

    memory: HostMemory
    allocation: Allocation
    regions: tuple[RegionDescriptor, ...]

    @classmethod
    def allocate(cls, memory: HostMemory, pool: PoolSpec, pages: int) -> HostPool:
        allocation = memory.allocate(pages * pool.page_bytes, "host")
        regions, offset = [], 0
        for c in pool.components:
            regions.append(RegionDescriptor(c.label, allocation.address + offset, c.piece_bytes, pages, c.piece_bytes))
            offset += c.piece_bytes * pages
        return cls(memory, allocation, tuple(regions))

    def write(self, slot: int, data: bytes) -> None:
        pos = 0
        for r in self.regions:
            ctypes.memmove(r.address(slot), data[pos : pos + r.piece_bytes], r.piece_bytes)
            pos += r.piece_bytes

    def read(self, slot: int) -> bytes:
        return b"".join(ctypes.string_at(r.address(slot), r.piece_bytes) for r in self.regions)

    def zero(self) -> None:
        ctypes.memset(self.allocation.address, 0, self.allocation.nbytes)

    def free(self) -> None:
        self.memory.free(self.allocation)


def build_node(
    name: str,
    port: int,
    page_bytes: int,
    slots: int,
    *,
    token: bytes | None = None,
    timing: Timing | None = None,
    peer: PeerSettings | None = None,
    transport: str = "nixl",
    verify_bytes: bool = False,
    page_digest: str = "xxh3",
    host: str = "127.0.0.1",
    node_secret_key: bytes | None = None,
    peer_directory_file: str | None = None,
    max_peer_leased_fraction: float = 1.0,
) -> RunnerNode:
    """A node holding ``slots`` pages of ``page_bytes``, built through the composition root."""
    pool = bench_pool(page_bytes)
    config = RunnerConfig(
        name,
        NamespaceSpec("kvcr-bench", PAGE_TOKENS, "bfloat16", "page_first"),
        (pool,),
        dram_bytes=slots * pool.page_bytes,
        timing=timing or Timing(),
        verify_bytes=verify_bytes,
        page_digest=page_digest,
        max_peer_leased_fraction=max_peer_leased_fraction,  # benchmarks: 1.0, everything from one peer
    )
    node_settings = NodeSettings(
        host,
        port,
        token=token,
        node_secret_key=node_secret_key,
        peer_directory_file=peer_directory_file,
        peer=peer or PeerSettings(),
    )
    return build_container(config, node=node_settings, transport=transport, control="zmq").node()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--page-bytes", type=int, required=True)
    parser.add_argument("--name", default="source")
    parser.add_argument("--host", default="127.0.0.1", help="control address (not loopback: needs --token-file)")
    parser.add_argument("--token-file")
    parser.add_argument("--node-key-file", help="per-node identity: this node's secret key (with --directory)")
    parser.add_argument("--directory", help="per-node identity: the peer directory file")
    parser.add_argument("--peer-share", type=float, default=1.0, help="the most of a pool one peer may lease")
    parser.add_argument("--lease-ms", type=int, default=10_000)
    parser.add_argument("--transport", default="nixl", help="the data plane: nixl or ucx")
    parser.add_argument("--verify-bytes", action="store_true", help="digest pages at backup (targets may check)")
    parser.add_argument("--page-digest", default="xxh3", help="with --verify-bytes: xxh3 or blake3")
    parser.add_argument(
        "--impostor", action="store_true", help="hold other bytes than page_pattern under the same keys (attack tests)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    token = Path(args.token_file).read_bytes().strip() if args.token_file else None
    timing = Timing(lease_s=args.lease_ms / 1000, lease_margin_s=min(0.5, args.lease_ms / 4000))
    # Twice the pages it holds: a peer may lease at most half of a pool (the owner keeps room to back up).
    node = build_node(
        args.name,
        args.port,
        args.page_bytes,
        2 * args.pages,
        token=token,
        timing=timing,
        transport=args.transport,
        verify_bytes=args.verify_bytes,
        page_digest=args.page_digest,
        host=args.host,
        node_secret_key=Path(args.node_key_file).read_bytes().strip() if args.node_key_file else None,
        peer_directory_file=args.directory,
        max_peer_leased_fraction=args.peer_share,
    )
    pool = bench_pool(args.page_bytes)
    host = HostPool.allocate(MmapHostMemory(), pool, args.pages)
    node.register_host_pool("kv", host.regions)
    keys = bench_keys(args.pages)
    for slot, key in enumerate(keys):
        host.write(slot, page_pattern(key + "impostor" if args.impostor else key, pool.page_bytes))
    stored = node.runner.backup("kv", keys, list(range(args.pages)))
    info = {
        "endpoint": node.endpoint,
        "namespace": node.runner.namespace,
        "namespaces": node.runner.namespaces,  # per pool: what a HELLO offers
        "stored": sum(stored),
        "keys": keys,
    }
    print("READY " + json.dumps(info), flush=True)
    try:
        sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
    finally:
        node.close()
        host.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
