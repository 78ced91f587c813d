"""Shared test helpers: host pools in real memory, deterministic page contents, runner builders."""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

from kvcr.domain.keys import NamespaceSpec, page_hashes
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import HitPolicy, PoolSpec
from kvcr.runner import KvcrRunner, RunnerConfig


class HostPool:
    """An engine-style host pool: one dense region per component in one real buffer."""

    def __init__(self, pool: PoolSpec, pages: int) -> None:
        self.pool = pool
        self.pages = pages
        total = sum(c.piece_bytes for c in pool.components) * pages
        self.buffer = ctypes.create_string_buffer(total)
        base = ctypes.addressof(self.buffer)
        self.regions = []
        offset = 0
        for c in pool.components:
            self.regions.append(
                RegionDescriptor(f"test/{pool.name}/{c.label}", base + offset, c.piece_bytes, pages, c.piece_bytes)
            )
            offset += c.piece_bytes * pages

    def write_page(self, slot: int, data: bytes) -> None:
        pos = 0
        for r in self.regions:
            ctypes.memmove(r.address(slot), data[pos : pos + r.piece_bytes], r.piece_bytes)
            pos += r.piece_bytes

    def read_page(self, slot: int) -> bytes:
        return b"".join(ctypes.string_at(r.address(slot), r.piece_bytes) for r in self.regions)

    def zero_page(self, slot: int) -> None:
        for r in self.regions:
            ctypes.memset(r.address(slot), 0, r.piece_bytes)


def content(page_hash: str, nbytes: int, salt: str = "") -> bytes:
    """Deterministic bytes for a page (different for every page, pool and salt)."""
    seed = hashlib.sha256((page_hash + salt).encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def sequence(n_pages: int, page_size: int = 4, start: int = 0) -> list[str]:
    return page_hashes(list(range(start, start + n_pages * page_size)), page_size)


def kv_pool(piece: int = 256) -> PoolSpec:
    return PoolSpec("kv", (ComponentSpec("k", piece), ComponentSpec("v", piece)), anchor=True)


def indexer_pool(piece: int = 64) -> PoolSpec:
    return PoolSpec("indexer", (ComponentSpec("i", piece),))


def mamba_pool(piece: int = 64) -> PoolSpec:
    return PoolSpec("mamba", (ComponentSpec("conv", piece), ComponentSpec("ssm", piece)), HitPolicy.TRAILING_PAGES)


def runner_config(pools: tuple[PoolSpec, ...], slots: int, *, name: str = "r0", **changes: Any) -> RunnerConfig:
    dram = slots * sum(p.page_bytes for p in pools if p.physical)
    return RunnerConfig(name, NamespaceSpec("test-model", 4, "bf16", "page_first"), pools, dram, **changes)


def make_runner(pools, slots, memory, clock, metrics, inventory, **changes) -> KvcrRunner:
    return KvcrRunner(
        runner_config(tuple(pools), slots, **changes), memory=memory, clock=clock, metrics=metrics, inventory=inventory
    )


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive free loopback ports (never fixed ports: see free_port_block)."""
    from kvcr.testing.ports import free_port_block

    return free_port_block(count)


class Cluster:
    """Runner nodes on one mock fabric (bytes really move), built through the composition root.

    ``control`` is the control adapter every node gets: ``"mock"`` (in-process) or ``"zmq"``
    (real sockets on loopback).
    """

    def __init__(self, clock=None, control="mock"):
        from kvcr.adapters.mock import FakeClock, MockFabric

        self.fabric = MockFabric()
        self.clock = clock or FakeClock()
        self.control = control
        self.nodes = []

    def node(
        self,
        name,
        port=None,
        *,
        pools=None,
        slots=16,
        token=None,
        identity=None,
        faults=None,
        model="m",
        timing=None,
        peer=None,
        verify_bytes=True,
        page_digest="xxh3",
        host_pages=64,
        peer_share=1.0,
    ):
        from kvcr.adapters.mock import MockDataPlane
        from kvcr.container import build_container
        from kvcr.domain.deadlines import Timing
        from kvcr.runner.node import NodeSettings
        from kvcr.runner.peer_client import PeerSettings

        pools = tuple(pools or (kv_pool(),))
        config = RunnerConfig(
            name,
            NamespaceSpec(model, 4, "bf16", "page_first"),
            pools,
            dram_bytes=slots * sum(p.page_bytes for p in pools),
            timing=timing or Timing(),
            verify_bytes=verify_bytes,
            page_digest=page_digest,
            # These pools are tiny: one peer may lease up to the pool's cap unless a test asks for the quota.
            max_peer_leased_fraction=peer_share,
        )
        key, directory = identity or (None, None)  # per-node identities: (secret key, directory file)
        settings = NodeSettings(
            "127.0.0.1",
            port or free_port(),
            token=token,
            node_secret_key=key,
            peer_directory_file=None if directory is None else str(directory),
            peer=peer or PeerSettings(),
            close_lease_wait_s=0.2,
        )
        container = build_container(
            config,
            node=settings,
            transport="mock",
            control=self.control,
            memory="mock",
            inventory="recording",
            metrics="strict",
        )
        container.fabric.override(self.fabric)
        container.clock.override(self.clock)
        if faults is not None:
            container.data_plane.override(MockDataPlane(self.fabric, name, self.clock, faults))
        node = container.node()
        node.container = container
        node.metrics = container.metrics()
        node.hosts = {p.name: HostPool(p, host_pages) for p in pools}
        for pool, host in node.hosts.items():
            node.register_host_pool(pool, host.regions)
        self.nodes.append(node)
        return node

    def close(self):
        import contextlib

        for node in self.nodes:
            with contextlib.suppress(Exception):  # a test may have closed or broken it on purpose
                node.close()


def seed(node, pages, slots, pool="kv", salt=""):
    """Write known pages into a node's host pool and back them up; all must be stored."""
    host = node.hosts[pool]
    for page, slot in zip(pages, slots, strict=True):
        host.write_page(slot, content(page, host.pool.page_bytes, salt))
    assert all(node.runner.backup(pool, pages, list(slots)))
