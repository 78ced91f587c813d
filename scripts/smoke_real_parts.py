#!/usr/bin/env python3
"""Smoke test of the real heavy parts kvcr builds on, on a CPU-only machine.

Run with the venv's python and the torchvision stub on the path:

    PYTHONPATH=tests/stubs .venv/bin/python scripts/smoke_real_parts.py [--only nixl,sglang,dynamo]

Prints one line per check: ``PASS <check>: <detail>`` or ``FAIL <check>: <error>``; exits 1 if any
check failed. Facts it relies on are written up in docs/dev-environment.md.

  (a) NIXL 1.5.1: two agents in one process (progress thread off), DRAM->DRAM READ of 8 x 64 KiB
      pages, byte check, the UCX transport reported by UCX_PROTO_INFO=y (in a child process), and
      the completion behaviour with ucx_error_handling_mode=none.
  (b) SGLang 0.5.23: module imports, the plugin HookRegistry, MHA/MLA host pools in page_first and
      page_first_direct with get_page_buffer_meta, a `dynamic` storage backend through
      StorageBackendFactory, the page-hash functions (checked against a pure-Python formula), and a
      HybridCacheController backup -> hit query -> prefetch round trip through that backend.
  (c) Dynamo 1.6.1: SelectionService in process, a BlockStored event published on a ZMQ PUB that the
      service subscribes to, and the kv.fetch@1.0 hint returned by select_and_reserve.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"

# Keep every cache this run may create inside the repo's ignored .cache/ (never in ~).
for _var, _sub in (
    ("SGLANG_CACHE_DIR", "sglang"),
    ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
    ("TRITON_CACHE_DIR", "triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ("HF_HOME", "huggingface"),
    ("XDG_CACHE_HOME", "xdg"),
    ("MPLCONFIGDIR", "matplotlib"),
):
    os.environ.setdefault(_var, str(CACHE / _sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX tcp (wireup / notifications) on loopback only

_STUBS = REPO / "tests" / "stubs"
if str(_STUBS) not in sys.path:
    sys.path.append(str(_STUBS))  # fallback when PYTHONPATH=tests/stubs was not given

RESULTS: list[tuple[str, bool]] = []


def check(name: str, fn: Callable[[], str]) -> bool:
    t0 = time.perf_counter()
    try:
        detail = fn()
        ok = True
    except Exception as exc:  # report and keep going
        detail = f"{type(exc).__name__}: {exc}"
        if os.environ.get("SMOKE_TRACEBACK"):
            traceback.print_exc()
        ok = False
    dt = time.perf_counter() - t0
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail} [{dt:.2f}s]", flush=True)
    RESULTS.append((name, ok))
    return ok


# ---------------------------------------------------------------------------------------------
# (a) NIXL
# ---------------------------------------------------------------------------------------------
PAGE = 64 * 1024
NPAGES = 8


def _nixl_pair(err_none: bool = False) -> tuple[Any, Any]:
    from nixl._api import nixl_agent, nixl_agent_config

    agents = []
    for name in ("A", "B"):
        if err_none:
            ag = nixl_agent(name + "n", nixl_agent_config(enable_prog_thread=False, backends=[]))
            ag.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        else:
            ag = nixl_agent(name, nixl_agent_config(enable_prog_thread=False))
        agents.append(ag)
    return agents[0], agents[1]


def _nixl_read(progress_target: bool, err_none: bool = False) -> dict[str, Any]:
    """B READs 8 pages (scattered order) out of A's buffer; returns timing/state facts."""
    import numpy as np

    a, b = _nixl_pair(err_none)
    rng = np.random.default_rng(1234)
    src = rng.integers(0, 256, size=2 * NPAGES * PAGE, dtype=np.uint8)  # page p lives at slot 2p
    dst = np.zeros(NPAGES * PAGE, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    a_name = b.add_remote_agent(a.get_agent_metadata())  # returns bytes (b'A'), not str
    a.add_remote_agent(b.get_agent_metadata())
    peer = a_name.decode() if isinstance(a_name, bytes) else a_name
    order = [7, 2, 5, 0, 3, 6, 1, 4]
    remote = np.array([(src.ctypes.data + 2 * p * PAGE, PAGE, 0) for p in order], dtype=np.uint64)
    local = np.array([(dst.ctypes.data + i * PAGE, PAGE, 0) for i in range(NPAGES)], dtype=np.uint64)
    rside = b.prep_xfer_dlist(peer, remote, "DRAM")
    lside = b.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    facts: dict[str, Any] = {"peer_name_type": type(a_name).__name__}
    notifs: dict[str, list[bytes]] = {}

    def drain_a() -> None:
        for k, v in a.get_new_notifs().items():
            notifs.setdefault(k, []).extend(v)

    for attempt in (1, 2):
        dst[:] = 0
        tag = f"smoke-{attempt}".encode()
        h = b.make_prepped_xfer("READ", lside, list(range(NPAGES)), rside, list(range(NPAGES)), tag)
        t0 = time.perf_counter()
        state = b.transfer(h)
        deadline = t0 + 1.5
        while state == "PROC" and time.perf_counter() < deadline:
            if progress_target:
                drain_a()  # get_new_notifs() drives A's UCX worker (no progress thread)
            state = b.check_xfer_state(h)
        facts[f"t{attempt}_us"] = round((time.perf_counter() - t0) * 1e6)
        facts[f"state{attempt}"] = state
        facts["backend"] = b.query_xfer_backend(h)
        ok = all(
            np.array_equal(dst[i * PAGE : (i + 1) * PAGE], src[2 * p * PAGE : (2 * p + 1) * PAGE])
            for i, p in enumerate(order)
        )
        facts[f"bytes{attempt}"] = ok
        if state == "DONE":
            h.release()
    for _ in range(100):
        drain_a()
        if sum(len(v) for v in notifs.values()) >= 2:
            break
        time.sleep(0.01)
    facts["notifs_at_A"] = {k: [x.decode() for x in v] for k, v in notifs.items()}
    return facts


def check_nixl_read() -> str:
    f = _nixl_read(progress_target=True)
    if not (f["state1"] == f["state2"] == "DONE" and f["bytes1"] and f["bytes2"]):
        raise RuntimeError(f"READ failed: {f}")
    return (
        f"8x64KiB READ A->B verified, backend={f['backend']}, first {f['t1_us']}us (wireup), "
        f"second {f['t2_us']}us, notifs at A={f['notifs_at_A']}, add_remote_agent returns {f['peer_name_type']}"
    )


def check_nixl_target_progress() -> str:
    """Default err=peer: does B's READ complete if A's worker is never progressed?"""
    f = _nixl_read(progress_target=False)
    fn = _nixl_read(progress_target=False, err_none=True)
    return (
        f"err=peer w/o target progress: state={f['state1']}/{f['state2']} bytes landed={f['bytes1']}/{f['bytes2']}; "
        f"ucx_error_handling_mode=none w/o target progress: state={fn['state1']}/{fn['state2']} "
        f"bytes={fn['bytes1']}/{fn['bytes2']} ({fn['t1_us']}us/{fn['t2_us']}us)"
    )


def _nixl_proto_child() -> None:
    f = _nixl_read(progress_target=True)
    print("SMOKE-CHILD-RESULT", f["state1"], f["bytes1"], flush=True)


def check_nixl_transport() -> str:
    env = dict(os.environ, UCX_PROTO_INFO="y")
    out = subprocess.run(
        [sys.executable, __file__, "--nixl-proto-child"], env=env, capture_output=True, text=True, timeout=120
    )
    text = out.stdout + out.stderr
    if "SMOKE-CHILD-RESULT DONE True" not in text:
        raise RuntimeError(f"child failed rc={out.returncode}: {text[-800:]}")

    def table(title: str) -> set[str]:
        lines = text.splitlines()
        found: set[str] = set()
        for i, line in enumerate(lines):
            if title in line:
                for row in lines[i + 1 : i + 12]:
                    cols = [c.strip() for c in row.split("|")]
                    if len(cols) >= 5 and cols[1] and cols[1][0].isdigit():
                        found.add(cols[3])
                    if "+-" in row and found:
                        break
        return found

    rma = table("remote memory read by ucp_get")
    am = table("active message by ucp_am_send")
    if not rma:
        raise RuntimeError("no 'remote memory read' table in UCX_PROTO_INFO output")
    return f"UCX_PROTO_INFO=y: RMA get via {sorted(rma)}; active messages via {sorted(am)}"


# ---------------------------------------------------------------------------------------------
# (b) SGLang
# ---------------------------------------------------------------------------------------------
SGLANG_MODULES = [
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.managers.kv_hints",
    "sglang.srt.disaggregation.kv_events",
]

L, H, D, P = 4, 2, 8, 16  # layers, heads, head_dim, page size (tokens)
MLA_DIM = 12  # kv_lora_rank 8 + rope 4


def check_sglang_imports() -> str:
    import importlib

    import torch

    times = []
    for m in SGLANG_MODULES:
        t0 = time.perf_counter()
        importlib.import_module(m)
        times.append(f"{m.rsplit('.', 1)[-1]}={time.perf_counter() - t0:.1f}s")
    import torchvision

    stub = getattr(torchvision, "KVCR_STUB", False)
    return f"{len(SGLANG_MODULES)} modules ok ({', '.join(times)}); torch {torch.__version__}; torchvision stub={stub}"


class _HookDemo:
    def method(self, x: int) -> int:
        return x * 10


def check_sglang_hooks() -> str:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    calls: list[str] = []

    def before(self: Any, x: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        calls.append("before")
        return (self, x + 1), {}

    def around(original: Callable[..., int], self: Any, x: int) -> int:
        calls.append("around")
        return original(self, x) + 5

    target = f"{__name__}._HookDemo.method"
    HookRegistry.register(target, before, HookType.BEFORE)
    HookRegistry.register(target, around, HookType.AROUND)
    load_plugins()  # runs entry-point plugins (none installed), then HookRegistry.apply_hooks()
    got = _HookDemo().method(1)
    HookRegistry.reset()
    if got != 25 or calls != ["around", "before"]:
        raise RuntimeError(f"unexpected hook result {got} / {calls}")
    return (
        f"BEFORE(x+1) then AROUND(+5) on {target}: method(1) -> {got}, call order {calls} "
        f"(later registration wraps outer); entry-point group '{GENERAL_PLUGINS_GROUP}'"
    )


def _mha_host(layout: str, device_tokens: int = 64, host_tokens: int | None = None) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(device_tokens + P, H, D, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(device_tokens + P, H, D, dtype=torch.bfloat16) for _ in range(L))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=make_kernel_ptr_table(list(k), "cpu", host_memory_registered=False),
            v_data_ptrs=make_kernel_ptr_table(list(v), "cpu", host_memory_registered=False),
            layout=KVBufferLayout.NHD,
        ),
        page_size=P,
        head_num=H,
        head_dim=D,
        v_head_dim=D,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,  # host_to_device_ratio
        0,  # host_size (GB); 0 -> use the ratio
        P,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=L,
        host_token_capacity=host_tokens,
    )


def _mla_host(layout: str, device_tokens: int = 64) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    bufs = tuple(torch.zeros(device_tokens + P, 1, MLA_DIM, dtype=torch.bfloat16) for _ in range(L))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=make_kernel_ptr_table(list(bufs), "cpu", host_memory_registered=False),
        layer_indices=tuple(range(L)),
        device_layer_num=L,
        page_size=P,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        kv_cache_dim=MLA_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        P,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=L,
        target_layer_num=L,
    )


def check_sglang_host_pools() -> str:
    parts = []
    for kind, make in (("MHA", _mha_host), ("MLA", _mla_host)):
        for layout in ("page_first", "page_first_direct"):
            pool = make(layout)
            idx = pool.alloc(2 * P)
            ptrs, sizes = pool.get_page_buffer_meta(idx)
            base = pool.kv_buffer.data_ptr()
            offs = [p - base for p in ptrs]
            parts.append(
                f"{kind}/{layout} kv_buffer{tuple(pool.kv_buffer.shape)} size={pool.size} "
                f"meta(2 pages)=offsets{offs} sizes{list(sizes)}"
            )
    return "; ".join(parts)


def _make_store_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

    class SmokeStore(HiCacheStorage):
        """Throwaway zero-copy backend: page bytes copied out of / into host pages with memmove."""

        instances: ClassVar[list[Any]] = []

        def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict) -> None:
            self.storage_config = storage_config
            self.ctor_kwargs = kwargs
            self.pages: dict[str, bytes] = {}
            self.calls: list[str] = []
            self.mem_pool_host = None
            SmokeStore.instances.append(self)

        # abstract legacy API: unused with interface_v1
        def get(self, key, target_location=None, target_sizes=None):
            raise NotImplementedError

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            raise NotImplementedError

        def set(self, key, value=None, target_location=None, target_sizes=None):
            raise NotImplementedError

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            raise NotImplementedError

        def exists(self, key):
            return key in self.pages

        def register_mem_pool_host(self, mem_pool_host):
            self.calls.append("register_mem_pool_host")
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            self.calls.append(f"register_mem_host_pool_v2({host_pool_name})")

        def on_host_pools_registered(self):
            self.calls.append("on_host_pools_registered")

        def batch_exists(self, keys, extra_info=None):
            self.calls.append(f"batch_exists({len(keys)})")
            n = 0
            for k in keys:
                if k not in self.pages:
                    break
                n += 1
            return n

        def _extents(self, host_indices):
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
            per_page = len(ptrs) // (len(host_indices) // self.mem_pool_host.page_size)
            return ptrs, sizes, per_page

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            self.calls.append(f"batch_set_v1({len(keys)})")
            ptrs, sizes, per = self._extents(host_indices)
            for i, key in enumerate(keys):
                chunks = [ctypes.string_at(ptrs[i * per + j], sizes[i * per + j]) for j in range(per)]
                self.pages[key] = b"".join(chunks)
            return [True] * len(keys)

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            self.calls.append(f"batch_get_v1({len(keys)})")
            ptrs, sizes, per = self._extents(host_indices)
            out = []
            for i, key in enumerate(keys):
                data = self.pages.get(key)
                if data is None:
                    out.append(False)
                    continue
                off = 0
                for j in range(per):
                    ctypes.memmove(ptrs[i * per + j], data[off : off + sizes[i * per + j]], sizes[i * per + j])
                    off += sizes[i * per + j]
                out.append(True)
            return out

        def clear(self):
            self.pages.clear()

        def close(self):
            self.calls.append("close")

    return SmokeStore


_STORE_CLASS: type | None = None


def _store_class() -> type:
    global _STORE_CLASS
    if _STORE_CLASS is None:
        _STORE_CLASS = _make_store_class()
        globals()["SmokeStore"] = _STORE_CLASS  # importable as <this module>.SmokeStore
    return _STORE_CLASS


def _extra_config() -> dict[str, Any]:
    return {"backend_name": "smoke", "module_path": __name__, "class_name": "SmokeStore", "interface_v1": 1}


def check_sglang_factory() -> str:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cls = _store_class()
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="smoke-model",
        extra_config=_extra_config(),
    )
    pool = _mha_host("page_first")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    inner = backend if isinstance(backend, cls) else getattr(backend, "_backend", backend)
    if not isinstance(inner, cls):
        raise RuntimeError(f"factory returned {type(backend)}")
    try:
        StorageBackendFactory.register_backend("smoke_named", __name__, "SmokeStore")
        StorageBackendFactory.create_backend("smoke_named", cfg, pool)
        named = "registered non-builtin name unexpectedly worked"
    except ValueError as exc:
        named = f"register_backend+non-builtin name -> ValueError({str(exc)[:60]!r})"
    finally:
        StorageBackendFactory._registry.pop("smoke_named", None)
    return (
        f"dynamic -> {type(backend).__name__}(storage_config, kwargs={inner.ctor_kwargs!r}); "
        f"extra_config visible as storage_config.extra_config={sorted(inner.storage_config.extra_config)}; {named}"
    )


def _py_page_hash(tokens: list[int], prior_hex: str | None, page_size: int) -> list[str]:
    """Pure-Python restatement of sglang/srt/mem_cache/cpp_utils/hash_binding.cpp (paged mode)."""
    import hashlib

    prior = bytes.fromhex(prior_hex) if prior_hex else None
    out = []
    for start in range(0, len(tokens), page_size):
        page = tokens[start : start + page_size]
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        if any(t > 0xFFFFFFFF for t in page):
            h.update(b"\xff" + b"".join(t.to_bytes(8, "little") for t in page))
        else:
            h.update(b"".join(t.to_bytes(4, "little") for t in page))
        prior = h.digest()
        out.append(prior.hex())
    return out


def _py_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """Pure-Python restatement of sglang.srt.mem_cache.utils.storage_namespace_seed."""
    import hashlib

    if extra_key is None and cache_salt is None:
        return None
    d = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            d.update(b"\x00")
        else:
            enc = part.encode("utf-8")
            d.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return d.hexdigest()


def check_sglang_page_hash() -> str:
    from sglang.srt.mem_cache.utils import (
        get_hash_str,
        get_storage_hash_str,
        hash_str_to_int64,
        storage_namespace_seed,
    )

    toks = list(range(1, 2 * P + 1))
    h = get_hash_str(toks, None, page_size=P)
    h_tail = get_hash_str(toks[P:], h[0], page_size=P)
    wide = [*toks[:P], 2**32 + 5, *toks[P + 1 :]]
    h_wide = get_hash_str(wide, None, page_size=P)
    whole = get_hash_str(toks[:P])  # page_size=None -> one hex string over the whole list
    seed = storage_namespace_seed("ek", None)
    h_ns = get_storage_hash_str(toks, None, page_size=P)  # plain list: no extra_key/cache_salt attrs
    partial = get_hash_str(toks[: P + 3], None, page_size=P)
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    h_key = get_storage_hash_str(RadixKey(array("q", toks), extra_key="ek"), None, page_size=P)
    checks = {
        "plain": h == _py_page_hash(toks, None, P),
        "chained": h_tail == [h[1]] and h_tail == _py_page_hash(toks[P:], h[0], P),
        "wide": h_wide == _py_page_hash(wide, None, P) and h_wide[0] == h[0] and h_wide[1] != h[1],
        "whole": whole == h[0],
        "storage_plain": h_ns == h,
        "partial_last_page": len(partial) == 2 and partial[1] == _py_page_hash(toks[: P + 3], None, P)[1],
        "namespace_seed": seed == _py_namespace_seed("ek", None),
        "namespaced_key": h_key == _py_page_hash(toks, seed, P) and h_key != h,
    }
    if not all(checks.values()):
        raise RuntimeError(f"hash mismatch {checks}")
    return (
        f"get_hash_str(1..{2 * P}, None, page_size={P}) = [{h[0][:16]}.., {h[1][:16]}..]; "
        f"chained(page2, prior=h0) = {h_tail[0][:16]}..; wide page2 = {h_wide[1][:16]}..; "
        f"storage_namespace_seed('ek', None) = {seed[:16]}..; hash_str_to_int64(h0) = {hash_str_to_int64(h[0])}; "
        f"pure-Python formula matches: {checks}"
    )


class _FakeDevicePool:
    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.layer_num = L
        self.counter = None

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _FakeAllocator:
    def __init__(self) -> None:
        self.pool = _FakeDevicePool()

    def get_kvcache(self) -> _FakeDevicePool:
        return self.pool

    def set_hicache_transfer_done_event(self, *args: Any) -> None:
        pass


def check_sglang_controller() -> str:
    import threading

    import torch
    from sglang.srt.managers.cache_controller import PrefetchAck
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.runtime_context import get_parallel

    cls = _store_class()
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    host = _mha_host("page_first")
    alloc = _FakeAllocator()
    group = HostPoolGroup(
        [
            PoolEntry(
                name=PoolName.KV,
                host_pool=host,
                device_pool=alloc.pool,
                layer_mapper=lambda i: i,
                is_primary_index_anchor=True,
            )
        ]
    )
    n0 = len(cls.instances)
    ctrl = HybridCacheController(
        token_to_kv_pool_allocator=alloc,
        mem_pool_host=group,
        page_size=P,
        tp_group=None,
        load_cache_event=threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        prefetch_threshold=P,
        model_name="smoke-model",
        storage_backend_extra_config=_extra_config(),
    )
    try:
        store = cls.instances[n0]
        tokens = list(range(100, 100 + 3 * P))
        hashes = get_hash_str(tokens, None, page_size=P)
        src_idx = group.alloc(3 * P)
        gen = torch.Generator().manual_seed(7)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.kv_buffer.dtype))
        ctrl.write_storage(src_idx, tokens, hash_value=hashes, prefix_keys=None)
        op = ctrl.ack_backup_queue.get(timeout=10)
        if op.completed_tokens != 3 * P:
            raise RuntimeError(f"backup completed {op.completed_tokens}")

        pf = ctrl.prefetch(CacheRequestHandle(rid="smoke-1", attempt_id=0), tokens, None, None)
        hit = ctrl.prefetch_hit_queue.get(timeout=10)
        assert hit is pf
        dst_idx, _alloc_len = ctrl.allocate_storage_hit(
            pf, pf.storage_hit_count, allow_partial=True, min_tokens=P, evict_host=lambda n: 0
        )
        pf.host_indices = dst_idx
        ctrl.prefetch_buffer.put(pf)
        acks: list[PrefetchAck] = []
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=10)
            acks.append(ack)
            if ack.completed_req:
                break
        same = all(
            torch.equal(host.get_data_page(int(src_idx[i * P])), host.get_data_page(int(dst_idx[i * P])))
            for i in range(3)
        )
        if not same:
            raise RuntimeError("prefetched pages differ from backed-up pages")
        ack_desc = [(a.completed_tokens, a.completed_req) for a in acks]
        return (
            f"HybridCacheController(io_backend='direct', tp_group=None, storage_backend='dynamic', interface_v1=1): "
            f"backup {op.completed_tokens} tok, hit {pf.storage_hit_count} tok, prefetch acks {ack_desc}, "
            f"bytes round-trip ok; backend calls {store.calls}; page_get_func={ctrl.page_get_func.__name__}"
        )
    finally:
        with contextlib.suppress(Exception):
            ctrl.detach_storage_backend()


# ---------------------------------------------------------------------------------------------
# (c) Dynamo
# ---------------------------------------------------------------------------------------------
def check_dynamo() -> str:
    import asyncio
    import json

    import msgpack
    import zmq
    from dynamo.llm import RadixTree, SelectionService, compute_block_hash_for_seq

    bs = P
    prompt = list(range(500, 500 + 4 * bs))
    try:
        from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

        page_hex = get_hash_str(prompt, None, page_size=bs)
        ev_hashes = [hash_str_to_int64(x) for x in page_hex]  # what SGLang publishes (signed int64)
        hash_src = "sglang get_hash_str -> hash_str_to_int64"
    except Exception:
        ev_hashes = [(0x1111111111111111 * (i + 1)) & (2**63 - 1) for i in range(4)]
        hash_src = "synthetic"
    local = compute_block_hash_for_seq(prompt, bs)
    _ = RadixTree  # imported to prove the export exists

    async def run() -> str:
        svc = SelectionService(indexer_threads=1)
        ctx = zmq.Context.instance()
        pubs: dict[int, Any] = {}
        try:
            for wid in (1, 2):
                sock = ctx.socket(zmq.PUB)
                sock.setsockopt(zmq.LINGER, 0)
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                pubs[wid] = (sock, port)
                await svc.upsert_worker(
                    {
                        "worker_id": wid,
                        "model_name": "smoke",
                        "block_size": bs,
                        "endpoint": f"http://127.0.0.1:{9000 + wid}",
                        "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                        "router_hint_worker_type": "aggregated",
                        "router_hint_source_control_endpoints": {0: f"tcp://127.0.0.1:{25000 + wid}"},
                    }
                )
            ready = svc.ready()
            events = [
                {
                    "type": "BlockStored",
                    "block_hashes": [ev_hashes[i]],
                    "parent_block_hash": ev_hashes[i - 1] if i else None,
                    "token_ids": prompt[i * bs : (i + 1) * bs],
                    "block_size": bs,
                    "lora_id": None,
                    "medium": "CPU",
                }
                for i in range(4)
            ]
            sock = pubs[1][0]
            seq = 0
            t0 = time.perf_counter()
            seen = 0
            # ZMQ slow joiner: the SUB side connects asynchronously, so (re)publish until applied.
            for attempt in range(40):
                if attempt % 10 == 0:
                    payload = msgpack.packb([time.time(), events, 0])
                    sock.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
                    seq += 1
                await asyncio.sleep(0.05)
                scores = await svc.overlap_scores({"model_name": "smoke", "token_ids": prompt})
                w1 = [w for w in scores["workers"] if w["worker_id"] == 1]
                seen = max((w1[0].get("host_pinned_blocks") or 0) if w1 else 0, seen)
                if seen == 4:
                    break
            applied_ms = (time.perf_counter() - t0) * 1e3
            query_only = await svc.select({"model_name": "smoke", "token_ids": prompt, "allowed_worker_ids": [2]})
            r = await svc.select_and_reserve(
                {"model_name": "smoke", "selection_id": "smoke-req-1", "token_ids": prompt, "allowed_worker_ids": [2]}
            )
            await svc.free_reservation("smoke-req-1")
            hint = r.get("kv_hint")
            want = [h & (2**64 - 1) for h in ev_hashes]
            got = hint["actions"][0]["payload"]["block_hashes"] if hint else None
            if got != want:
                raise RuntimeError(f"hint hashes {got} != event hashes as u64 {want}; result={r}")
            return (
                f"ready={ready['ready']}/{ready['schedulable_workers']} workers; event applied after "
                f"{applied_ms:.0f}ms ({seq} publish(es)); select() kv_hint={'kv_hint' in query_only}; "
                f"select_and_reserve -> worker {r['worker_id']}, kv_hint={json.dumps(hint)}; "
                f"hint hashes == ({hash_src}) & (2**64-1): True; "
                f"compute_block_hash_for_seq -> {len(local)} local hashes"
            )
        finally:
            svc.shutdown()
            for sock, _port in pubs.values():
                sock.close(0)

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="nixl,sglang,dynamo", help="comma list of: nixl, sglang, dynamo")
    ap.add_argument("--nixl-proto-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.nixl_proto_child:
        _nixl_proto_child()
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    print(f"python {sys.version.split()[0]} at {sys.executable}", flush=True)
    if "nixl" in only:
        check("nixl.read", check_nixl_read)
        check("nixl.transport", check_nixl_transport)
        check("nixl.target-progress", check_nixl_target_progress)
    if "sglang" in only and check("sglang.imports", check_sglang_imports):
        check("sglang.hooks", check_sglang_hooks)
        check("sglang.host-pools", check_sglang_host_pools)
        check("sglang.factory-dynamic", check_sglang_factory)
        check("sglang.page-hash", check_sglang_page_hash)
        check("sglang.controller", check_sglang_controller)
    if "dynamo" in only:
        check("dynamo.selection-service", check_dynamo)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
