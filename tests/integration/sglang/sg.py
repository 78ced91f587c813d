"""Builders for SGLang's real host pools, storage configs and controller on CPU."""

from __future__ import annotations

import importlib.metadata
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from kvcr.testing.sglang import host_pool, mla_host_pool
from tests.support import free_port as free_port  # re-exported for these tests

P, L, H, D = 16, 4, 2, 8
SGLANG = importlib.metadata.version("sglang")  # the release under test (CI runs the oldest supported too)
# what SGLang 0.5.23 added to the storage API; the older releases kvcr supports lack it
HAS_DECODE_CP = "dcp_size" in HiCacheStorageConfig.__dataclass_fields__


def hashes_wide_token_ids() -> bool:
    """SGLang 0.5.23 hashes 64-bit token ids; 0.5.22 packs them as uint32 and refuses wider ones."""
    try:
        get_hash_str([1 << 40], None, page_size=1)
    except OverflowError:
        return False
    return True


def mha_host(layout: str, pages: int = 17) -> Any:
    """SGLang's real MHA host pool, small: 4 layers, 2 heads x 8 dims, 16-token pages."""
    return host_pool(L, pages, page_tokens=P, heads=H, head_dim=D, layout=layout)


def mla_host(layout: str, device_tokens: int = 128) -> Any:
    return mla_host_pool(
        L, page_tokens=P, kv_lora_rank=8, qk_rope_head_dim=4, layout=layout, device_tokens=device_tokens
    )


def extra_config(**settings: Any) -> dict[str, Any]:
    base = {
        "backend_name": "kvcr",
        "module_path": "kvcr.integrations.sglang",
        "class_name": "KvcrHiCacheStorage",
        "interface_v1": 1,
        "transport": "mock",
        "dram_bytes": "4MiB",
        "control_port": 0,
    }
    base.update(settings)
    return base


def storage_config(
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    dp_rank: int = 0,
    pp_size: int = 1,
    split_heads: bool = False,
    model: str = "test-model",
    storage_metrics: bool = False,
    **settings: Any,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=storage_metrics,
        is_page_first_layout=True,
        model_name=model,
        should_split_heads=split_heads,
        dp_rank=dp_rank,
        extra_config=extra_config(**settings),
    )


def backend(host: Any, config: HiCacheStorageConfig) -> Any:
    """Create the backend the way SGLang does: factory, dynamic route, then registration."""
    store = StorageBackendFactory.create_backend("dynamic", config, host)
    store.register_mem_pool_host(host)
    store.register_mem_host_pool_v2(host, "kv")
    store.on_host_pools_registered()
    return store


def fill(host: Any, indices: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(indices), P):
        page = host.get_data_page(int(indices[start]), flat=True)
        host.set_from_flat_data_page(int(indices[start]), torch.randn(page.shape, generator=gen).to(page.dtype))


def pages_equal(host_a: Any, idx_a: torch.Tensor, host_b: Any, idx_b: torch.Tensor) -> bool:
    return all(
        torch.equal(host_a.get_data_page(int(idx_a[i]), flat=True), host_b.get_data_page(int(idx_b[i]), flat=True))
        for i in range(0, len(idx_a), P)
    )


def hashes(n_pages: int, start: int = 0) -> list[str]:
    return get_hash_str(list(range(start, start + n_pages * P)), None, page_size=P)


class FakeDevicePool:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.layer_num = L
        self.counter = None

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class FakeAllocator:
    """The four members SGLang's cache controller touches on the device side."""

    def __init__(self) -> None:
        self.pool = FakeDevicePool()

    def get_kvcache(self) -> FakeDevicePool:
        return self.pool

    def set_hicache_transfer_done_event(self, *args: Any) -> None:
        pass


def controller(
    host: Any, *, storage_metrics: bool = False, tp_group: Any = None, attn_tp_group: Any = None, **settings: Any
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    alloc = FakeAllocator()
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
    ctrl = HybridCacheController(
        token_to_kv_pool_allocator=alloc,
        mem_pool_host=group,
        page_size=P,
        tp_group=tp_group,
        attn_tp_group=attn_tp_group,
        load_cache_event=threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        prefetch_threshold=P,
        model_name="test-model",
        storage_backend_extra_config=extra_config(**settings),
        enable_storage_metrics=storage_metrics,
    )
    return ctrl, group


def prefetch(ctrl: Any, rid: str, tokens: list[int], timeout: float = 30.0) -> tuple[Any, Any, int]:
    """Drive SGLang's controller through one storage prefetch the way the scheduler does.

    Returns the operation, the host indices it filled (None on no hit) and the prefetched tokens.
    """
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    op = ctrl.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), tokens, None, None)
    return finish_prefetch(ctrl, op, timeout)


def finish_prefetch(ctrl: Any, op: Any, timeout: float = 30.0) -> tuple[Any, Any, int]:
    """The rest of a prefetch ``ctrl.prefetch`` started: the hit, the host pages for it, the reads."""
    if ctrl.prefetch_hit_queue.get(timeout=timeout) is not op:
        raise AssertionError("the controller answered another operation's hit query")
    if not op.storage_hit_count:
        return op, None, 0
    dst, _ = ctrl.allocate_storage_hit(
        op, op.storage_hit_count, allow_partial=True, min_tokens=P, evict_host=lambda n: 0
    )
    op.host_indices = dst
    ctrl.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=timeout)
        completed = max(completed, ack.completed_tokens or 0)
        if ack.completed_req:
            return op, dst, completed
