"""SGLang path benchmark: ``batch_set_v1`` / ``batch_get_v1`` through kvcr vs memcpy of the same bytes.

An SGLang 0.5.23 ``MHATokenToKVPoolHost`` (page_first, bf16, 64-token pages, 8 heads x 128 dims;
the layer count sets the page size: 4 layers = 1 MiB, 8 = 2 MiB, 32 = 8 MiB per page) is built on
the CPU and registered with a ``KvcrHiCacheStorage`` created through SGLang's storage factory
(``dynamic`` route, ``interface_v1``). The baseline buffer is host memory of the same kind as
kvcr's arena (anonymous mmap), so each ratio compares kvcr with a plain copy between the same two
kinds of memory in the same direction. Per repetition, interleaved: memcpy of the same K and V
extents into a warm buffer, ``batch_set_v1`` of 128 fresh pages (the tier is full after the first
repetition, so each backup also evicts), ``batch_get_v1`` of those pages into other host slots.
Every restored page is compared with its source once.

On a CPU-only machine SGLang needs an import-only torchvision; this module uses the repo's test
stub when no torchvision is installed (run it from a checkout).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass

from kvcr.adapters.local import MmapHostMemory
from kvcr.bench.stats import markdown_table, timing
from kvcr.domain.units import format_byte_size
from kvcr.testing.sglang import LAYER_BYTES, PAGE_TOKENS, backend, host_pool, prepare_environment, storage_config


@dataclass(frozen=True, slots=True)
class SglangResult:
    page_bytes: int
    pages: int
    reps: int
    memcpy_in_gbps: float
    memcpy_out_gbps: float
    set_gbps: float
    get_gbps: float
    set_ratio: float
    get_ratio: float
    verified: bool


def run_sglang(layers: int, pages: int, reps: int) -> SglangResult:
    prepare_environment()
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    page_bytes = layers * LAYER_BYTES
    host = host_pool(layers, 2 * pages)
    host.kv_buffer.view(torch.int16).random_()
    store = backend(host, storage_config(0, transport="mock", dram_bytes=pages * page_bytes))
    src = torch.arange(0, pages * PAGE_TOKENS, dtype=torch.int64)
    dst = torch.arange(pages * PAGE_TOKENS, 2 * pages * PAGE_TOKENS, dtype=torch.int64)
    ptrs, sizes = host.get_page_buffer_meta(src[:PAGE_TOKENS])
    dst_ptrs, _ = host.get_page_buffer_meta(dst[:PAGE_TOKENS])
    half = pages * int(sizes[0])
    memory = MmapHostMemory()
    baseline = memory.allocate(2 * half, "bench/baseline")
    base = baseline.address
    memcpy_in_s, memcpy_out_s, set_s, get_s = [], [], [], []
    verified = False
    try:
        for rep in range(reps + 1):
            keys = get_hash_str(
                list(range(rep * pages * PAGE_TOKENS, (rep + 1) * pages * PAGE_TOKENS)), None, page_size=PAGE_TOKENS
            )
            t0 = time.perf_counter()
            ctypes.memmove(base, int(ptrs[0]), half)  # the same K extents ...
            ctypes.memmove(base + half, int(ptrs[1]), half)  # ... and V extents the backend copies
            t1 = time.perf_counter()
            stored = store.batch_set_v1(keys, src)
            t2 = time.perf_counter()
            ctypes.memmove(int(dst_ptrs[0]), base, half)  # the same bytes into the destination slots
            ctypes.memmove(int(dst_ptrs[1]), base + half, half)
            t3 = time.perf_counter()
            restored = store.batch_get_v1(keys, dst)
            t4 = time.perf_counter()
            if not all(stored) or not all(restored):
                raise RuntimeError("benchmark pages were not all stored and restored")
            if not verified:
                bits = host.kv_buffer.view(torch.int16)  # compare bits: random bf16 patterns include NaNs
                verified = bool(
                    torch.equal(
                        bits[:, : pages * PAGE_TOKENS],
                        bits[:, pages * PAGE_TOKENS : 2 * pages * PAGE_TOKENS],
                    )
                )
                if not verified:
                    raise RuntimeError("restored pages differ from the backed-up pages")
            if rep:
                memcpy_in_s.append(t1 - t0)
                set_s.append(t2 - t1)
                memcpy_out_s.append(t3 - t2)
                get_s.append(t4 - t3)
    finally:
        store.close()
        memory.free(baseline)
    nbytes = pages * page_bytes
    m_in, m_out, st, gt = timing(memcpy_in_s), timing(memcpy_out_s), timing(set_s), timing(get_s)
    return SglangResult(
        page_bytes,
        pages,
        reps,
        m_in.gbps(nbytes),
        m_out.gbps(nbytes),
        st.gbps(nbytes),
        gt.gbps(nbytes),
        m_in.p50 / st.p50,
        m_out.p50 / gt.p50,
        verified,
    )


def sglang_table(results: list[SglangResult]) -> str:
    rows = [
        [
            f"{format_byte_size(r.page_bytes)} x {r.pages}",
            f"{r.memcpy_in_gbps:.1f}",
            f"{r.set_gbps:.1f}",
            f"{r.memcpy_out_gbps:.1f}",
            f"{r.get_gbps:.1f}",
            f"{r.set_ratio:.2f}x",
            f"{r.get_ratio:.2f}x",
        ]
        for r in results
    ]
    header = [
        "pages",
        "memcpy in GB/s",
        "batch_set_v1 GB/s",
        "memcpy out GB/s",
        "batch_get_v1 GB/s",
        "set vs memcpy",
        "get vs memcpy",
    ]
    return markdown_table(header, rows)


def as_dict(result: SglangResult | SglangRemoteResult) -> dict[str, object]:
    return asdict(result)


@dataclass(frozen=True, slots=True)
class SglangRemoteResult:
    page_bytes: int
    pages: int
    reps: int
    raw_gbps: float
    get_gbps: float
    exists_and_get_gbps: float
    get_vs_raw: float
    exists_and_get_vs_raw: float
    verified: bool
    transport: str = "nixl"


def run_sglang_remote(
    layers: int,
    pages: int,
    reps: int,
    request: Callable[[], AbstractContextManager[object]] = nullcontext,
    transport: str = "nixl",
) -> SglangRemoteResult:
    """Hinted remote restore through SGLang's calls vs a raw NIXL READ of the same pieces.

    Replica A (``kvcr.testing.sglang_replica``, another process) holds the pages. Replica B is a kvcr
    backend built by SGLang's factory. Per repetition, interleaved: a raw NIXL READ of A's leased
    pieces into B's destination host slots; ``batch_exists`` with the hint (LEASE) then
    ``batch_get_v1`` (the READ, timed alone as "get" and with the hit query as "exists+get").
    ``request`` is the scope both calls run in: SGLang with kvcr's plugin runs them under the
    request's id (the CLI passes ``hints_bridge.active``), so the hit query's lease is booked for
    the read; without one the read leases again. ``transport`` is both replicas' (with ``auto`` on
    one host kvcr reads over shm while the baseline reads A's NIXL half).
    """
    prepare_environment()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvcr.bench.remote import RawReader, data_plane_description, source_replica_process
    from kvcr.domain.keys import router_id
    from kvcr.testing.ports import free_port_block
    from kvcr.testing.sglang_replica import expected_pages

    page_bytes = layers * LAYER_BYTES
    port = free_port_block(3)
    cmd = [
        "-m",
        "kvcr.testing.sglang_replica",
        "--port",
        str(port),
        "--pages",
        str(pages),
        "--layers",
        str(layers),
        "--seed",
        "3",
        "--transport",
        transport,
    ]
    with source_replica_process(cmd) as info:
        host = host_pool(layers, pages)
        config = storage_config(port + 1, enable_remote_hint=True, dram_bytes=page_bytes * 4, transport=transport)
        store = backend(host, config)
        keys: list[str] = info["keys"]
        envelope = {
            "protocol_version": "0.1",
            "message_id": "bench",
            "actions": [
                {
                    "action_id": "a1",
                    "action_type": "kv.fetch",
                    "action_version": "1.0",
                    "payload": {
                        "source_control_endpoint": info["endpoint"],
                        "block_hashes": [router_id(k) for k in keys],
                    },
                }
            ],
        }
        hint = HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope})
        dst = torch.arange(pages * PAGE_TOKENS, dtype=torch.int64)
        regions = store.runner.pool_host_regions("kv")
        raw = None
        try:
            lease = store.node.client.lease(info["endpoint"], [("kv", keys)])
            if lease is None or len(lease.slots) != pages:
                raise RuntimeError("could not lease replica A's pages")
            description, region_ids = data_plane_description(info["endpoint"], dict(store.runner.namespaces), port + 2)
            span = (host.kv_buffer.data_ptr(), host.kv_buffer.numel() * host.kv_buffer.element_size())
            raw = RawReader(
                f"bench-sglang-raw-{os.getpid()}",
                description,
                region_ids,
                regions,
                span,
                [r.piece_bytes for r in regions],
            )
            raw.target([lease.slots[("kv", k)] for k in keys], list(range(pages)))
            store.node.client.release(lease)

            def exists_and_get() -> float:
                with request():  # the hit query's lease is booked for the read only under a request id
                    if store.batch_exists(keys, hint) != pages:
                        raise RuntimeError("the hinted hit query did not count every page")
                    started = time.perf_counter()
                    if not all(store.batch_get_v1(keys, dst, hint)):
                        raise RuntimeError("the hinted read did not restore every page")
                    return time.perf_counter() - started

            host.kv_buffer.zero_()
            exists_and_get()
            verified = bool(torch.equal(host.kv_buffer.view(torch.int16), expected_pages(layers, pages, seed=3)))
            if not verified:
                raise RuntimeError("hinted restore bytes differ from replica A's pages")
            raw.read()
            raw_s, get_s, both_s = [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                raw.read()
                t1 = time.perf_counter()
                get_only = exists_and_get()
                t2 = time.perf_counter()
                raw_s.append(t1 - t0)
                get_s.append(get_only)
                both_s.append(t2 - t1)
        finally:
            if raw is not None:
                raw.close()
            store.close()
    nbytes = pages * page_bytes
    r, g, b = timing(raw_s), timing(get_s), timing(both_s)
    return SglangRemoteResult(
        page_bytes,
        pages,
        reps,
        r.gbps(nbytes),
        g.gbps(nbytes),
        b.gbps(nbytes),
        r.p50 / g.p50,
        r.p50 / b.p50,
        verified,
        transport,
    )


def sglang_remote_table(results: list[SglangRemoteResult]) -> str:
    rows = [
        [
            f"{format_byte_size(r.page_bytes)} x {r.pages}" + ("" if r.transport == "nixl" else f" ({r.transport})"),
            f"{r.raw_gbps:.1f}",
            f"{r.get_gbps:.1f}",
            f"{r.exists_and_get_gbps:.1f}",
            f"{r.get_vs_raw:.2f}x",
            f"{r.exists_and_get_vs_raw:.2f}x",
        ]
        for r in results
    ]
    header = [
        "pages",
        "raw NIXL READ GB/s",
        "hinted batch_get_v1 GB/s",
        "batch_exists + batch_get_v1 GB/s",
        "get vs raw",
        "exists+get vs raw",
    ]
    return markdown_table(header, rows)
