"""Local tier benchmark: backup and restore of N pages against a plain copy of the same bytes.

For each page size the run allocates a host pool (2 components per page, like MHA K/V halves,
with 2N pages) and a runner whose arena holds exactly N pages, then interleaves, per repetition:

* memcpy   — one memmove per component of the same N pieces into a warm destination;
* backup   — N fresh pages into kvcr DRAM (from the second repetition on, every backup also
             evicts N pages, so this is the steady state of a full tier);
* restore  — the same N pages back into other host slots;
* query    — a query of those N keys (reported as a median time);
* verified backup / restore — the same on a second runner with ``verify_bytes`` on (a digest per
  page at backup, checked at restore): what turning integrity checks on costs, same run;
* the same on a third runner with ``page_digest: blake3`` (the cryptographic digest).

Every restore is checked byte for byte once per page size. Ratios are p50 throughput of the kvcr
path over p50 throughput of memcpy in the same run.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import asdict, dataclass

from kvcr.adapters.local import MmapHostMemory
from kvcr.bench.stats import markdown_table, timing
from kvcr.container import build_container
from kvcr.domain.keys import NamespaceSpec, page_hashes
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.domain.units import format_byte_size
from kvcr.ports.memory import Move
from kvcr.runner import KvcrRunner, RunnerConfig


@dataclass(frozen=True, slots=True)
class LocalResult:
    page_bytes: int
    pages: int
    reps: int
    memcpy_gbps: float
    backup_gbps: float
    restore_gbps: float
    backup_ratio: float
    restore_ratio: float
    memcpy_p50_ms: float
    backup_p50_ms: float
    restore_p50_ms: float
    query_p50_us: float
    verified: bool
    verify_backup_ratio: float = 0.0  # backup throughput with verify_bytes on / without, same run
    verify_restore_ratio: float = 0.0
    blake3_backup_ratio: float = 0.0  # backup throughput with verify_bytes on and page_digest blake3 / without
    blake3_restore_ratio: float = 0.0


def run_local(page_bytes: int, pages: int, reps: int) -> LocalResult:
    half = page_bytes // 2
    pool = PoolSpec("kv", (ComponentSpec("k", half), ComponentSpec("v", page_bytes - half)), anchor=True)
    memory = MmapHostMemory()
    blake3_memory = MmapHostMemory(page_digest="blake3")

    def make_runner(verify_bytes: bool, digest: str = "xxh3") -> KvcrRunner:
        namespace = NamespaceSpec("bench", 64, "bf16", "page_first")
        config = RunnerConfig(
            "bench", namespace, (pool,), dram_bytes=pages * page_bytes, verify_bytes=verify_bytes, page_digest=digest
        )
        container = build_container(config)
        # The runners and the baseline share one memory adapter per digest (its allocations are plain addresses).
        container.memory.override(blake3_memory if digest == "blake3" else memory)
        return container.runner()

    runner, checking, strong = make_runner(False), make_runner(True), make_runner(True, "blake3")
    host_pages = 2 * pages
    host = memory.allocate(host_pages * page_bytes, "bench/host")
    baseline_dst = memory.allocate(pages * page_bytes, "bench/baseline")
    try:
        regions = []
        offset = 0
        for component in pool.components:
            size = component.piece_bytes
            regions.append(RegionDescriptor(component.label, host.address + offset, size, host_pages, size))
            offset += size * host_pages
        runner.register_host_pool("kv", regions)
        checking.register_host_pool("kv", regions)
        strong.register_host_pool("kv", regions)
        ctypes.memmove(host.address, os.urandom(host.nbytes), host.nbytes)
        src_slots = list(range(pages))
        dst_slots = list(range(pages, 2 * pages))
        baseline = []
        dst_offset = 0
        for r in regions:
            n = r.piece_bytes * pages
            baseline.append(Move(baseline_dst.address + dst_offset, r.base, n))
            dst_offset += n

        memcpy_s, backup_s, restore_s, query_s, checked_backup_s, checked_restore_s = [], [], [], [], [], []
        strong_backup_s: list[float] = []
        strong_restore_s: list[float] = []
        verified = False
        for rep in range(reps + 1):  # repetition 0 warms up and is not counted
            keys = page_hashes(list(range(rep * pages * 4, (rep + 1) * pages * 4)), 4)
            t0 = time.perf_counter()
            memory.copy(baseline)
            t1 = time.perf_counter()
            stored = runner.backup("kv", keys, src_slots)
            t2 = time.perf_counter()
            outcomes = runner.restore("kv", keys, dst_slots)
            t3 = time.perf_counter()
            runner.query("kv", keys)
            t4 = time.perf_counter()
            checked_stored = checking.backup("kv", keys, src_slots)
            t5 = time.perf_counter()
            checked = checking.restore("kv", keys, dst_slots)
            t6 = time.perf_counter()
            strong_stored = strong.backup("kv", keys, src_slots)
            t7 = time.perf_counter()
            strongly_checked = strong.restore("kv", keys, dst_slots)
            t8 = time.perf_counter()
            if not all([*stored, *checked_stored, *strong_stored]) or not all(
                o.restored for o in [*outcomes, *checked, *strongly_checked]
            ):
                raise RuntimeError("benchmark pages were not all stored and restored")
            if not verified:
                verified = all(
                    ctypes.string_at(r.address(s), r.piece_bytes) == ctypes.string_at(r.address(d), r.piece_bytes)
                    for r in regions
                    for s, d in zip(src_slots, dst_slots, strict=True)
                )
                if not verified:
                    raise RuntimeError("restored bytes differ from the backed-up bytes")
            if rep:
                memcpy_s.append(t1 - t0)
                backup_s.append(t2 - t1)
                restore_s.append(t3 - t2)
                query_s.append(t4 - t3)
                checked_backup_s.append(t5 - t4)
                checked_restore_s.append(t6 - t5)
                strong_backup_s.append(t7 - t6)
                strong_restore_s.append(t8 - t7)
        nbytes = pages * page_bytes
        memcpy_t, backup_t, restore_t = timing(memcpy_s), timing(backup_s), timing(restore_s)
        return LocalResult(
            page_bytes=page_bytes,
            pages=pages,
            reps=reps,
            memcpy_gbps=memcpy_t.gbps(nbytes),
            backup_gbps=backup_t.gbps(nbytes),
            restore_gbps=restore_t.gbps(nbytes),
            backup_ratio=memcpy_t.p50 / backup_t.p50,
            restore_ratio=memcpy_t.p50 / restore_t.p50,
            memcpy_p50_ms=memcpy_t.p50 * 1e3,
            backup_p50_ms=backup_t.p50 * 1e3,
            restore_p50_ms=restore_t.p50 * 1e3,
            query_p50_us=timing(query_s).p50 * 1e6,
            verified=verified,
            verify_backup_ratio=backup_t.p50 / timing(checked_backup_s).p50,
            verify_restore_ratio=restore_t.p50 / timing(checked_restore_s).p50,
            blake3_backup_ratio=backup_t.p50 / timing(strong_backup_s).p50,
            blake3_restore_ratio=restore_t.p50 / timing(strong_restore_s).p50,
        )
    finally:
        runner.close()
        checking.close()
        strong.close()
        memory.free(host)
        memory.free(baseline_dst)
        blake3_memory.close()


def local_table(results: list[LocalResult]) -> str:
    rows = [
        [
            f"{format_byte_size(r.page_bytes)} x {r.pages}",
            f"{r.memcpy_p50_ms:.2f} / {r.memcpy_gbps:.1f}",
            f"{r.backup_p50_ms:.2f} / {r.backup_gbps:.1f}",
            f"{r.restore_p50_ms:.2f} / {r.restore_gbps:.1f}",
            f"{r.backup_ratio:.2f}x",
            f"{r.restore_ratio:.2f}x",
            f"{r.query_p50_us:.0f}",
            f"{r.verify_backup_ratio:.2f}x / {r.verify_restore_ratio:.2f}x" if r.verify_backup_ratio else "-",
            f"{r.blake3_backup_ratio:.2f}x / {r.blake3_restore_ratio:.2f}x" if r.blake3_backup_ratio else "-",
        ]
        for r in results
    ]
    header = [
        "pages",
        "memcpy ms / GB/s",
        "backup ms / GB/s",
        "restore ms / GB/s",
        "backup vs memcpy",
        "restore vs memcpy",
        f"query of {results[0].pages} keys, µs" if results else "query µs",
        "with verify_bytes: backup / restore vs without",
        "with verify_bytes and page_digest blake3: backup / restore vs without",
    ]
    return markdown_table(header, rows)


def as_dict(result: LocalResult) -> dict[str, object]:
    return asdict(result)
