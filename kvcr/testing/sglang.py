"""SGLang's real classes on the CPU (0.5.22 and 0.5.23), as kvcr's tests, benchmarks and replica processes use them.

``host_pool`` builds a real ``MHATokenToKVPoolHost`` (page_first, bf16, 64-token pages, 8 heads x
128 dims; the layer count sets the page size); ``storage_config`` a single-rank
``HiCacheStorageConfig`` selecting kvcr; ``backend`` creates and registers kvcr the way SGLang
does (factory ``dynamic`` route, then the pools). On a CPU-only machine SGLang needs an
import-only torchvision; ``prepare_environment`` uses the repo's test stub when none is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kvcr.domain.errors import KvcrError

PAGE_TOKENS, HEADS, HEAD_DIM = 64, 8, 128
LAYER_BYTES = 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2  # K and V of one layer of one page, bf16


def prepare_environment() -> None:
    repo = Path(__file__).resolve().parents[2]
    # a checkout keeps caches in its ignored .cache/; an installed wheel in the user's cache directory
    cache = repo / ".cache" if (repo / "pyproject.toml").is_file() else _user_cache()
    for var, sub in (
        ("SGLANG_CACHE_DIR", "sglang"),
        ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
        ("TRITON_CACHE_DIR", "triton"),
        ("HF_HOME", "huggingface"),
    ):
        os.environ.setdefault(var, str(cache / sub))
    stubs = Path(__file__).resolve().parent / "stubs"  # shipped in the wheel, so the demo runs from it
    if importlib.util.find_spec("torchvision") is None and stubs.is_dir() and str(stubs) not in sys.path:
        sys.path.append(str(stubs))


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcr"


def host_pool(
    layers: int,
    pages: int,
    *,
    page_tokens: int = PAGE_TOKENS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    layout: str = "page_first",
) -> Any:
    """SGLang's real MHA host pool on the CPU (bf16), holding exactly ``pages`` pages."""
    import torch
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if not describes_device_pools():
        # SGLang 0.5.22 builds a host pool from a device pool: a small CPU one lends the shapes
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        device = MHATokenToKVPool(
            (pages - 1) * page_tokens,  # the host pool adds one page to what it mirrors
            page_tokens,
            torch.bfloat16,
            heads,
            head_dim,
            layers,
            "cpu",
            False,
            enable_alt_stream=False,
        )
        host = MHATokenToKVPoolHost(device, 1.0, 0, page_tokens, layout, pin_memory=False, device="cpu")
        return _exactly(host, pages)

    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table

    tokens = page_tokens  # the device pool only lends shapes; the host pool is sized explicitly
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=make_kernel_ptr_table(list(k), "cpu", host_memory_registered=False),
            v_data_ptrs=make_kernel_ptr_table(list(v), "cpu", host_memory_registered=False),
            layout=KVBufferLayout.NHD,
        ),
        page_size=page_tokens,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        page_tokens,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=pages * page_tokens,
    )


def mla_host_pool(
    layers: int,
    *,
    page_tokens: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    layout: str,
    device_tokens: int,
) -> Any:
    """SGLang's real MLA host pool on the CPU (bf16), twice the size of a ``device_tokens`` device pool."""
    import torch
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if not describes_device_pools():
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        device = MLATokenToKVPool(
            device_tokens, page_tokens, torch.bfloat16, kv_lora_rank, qk_rope_head_dim, layers, "cpu", False
        )
        return MLATokenToKVPoolHost(device, 2.0, 0, page_tokens, layout, pin_memory=False, device="cpu")

    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table

    dim = kv_lora_rank + qk_rope_head_dim
    bufs = tuple(torch.zeros(device_tokens + page_tokens, 1, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=make_kernel_ptr_table(list(bufs), "cpu", host_memory_registered=False),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_tokens,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        kv_cache_dim=dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_tokens,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def describes_device_pools() -> bool:
    """Whether this SGLang builds host pools from a description of the device pool (0.5.23) rather
    than from the device pool itself (0.5.22)."""
    from sglang.srt.mem_cache import device_pool_info

    return hasattr(device_pool_info, "MHABufferInfo")


def _exactly(host: Any, pages: int) -> Any:
    if host.size != pages * host.page_size:
        raise KvcrError(f"SGLang sized the host pool at {host.size} tokens, not the {pages} pages asked for")
    return host


def storage_config(port: int, **settings: Any) -> Any:
    """A single-rank HiCacheStorageConfig selecting kvcr (nixl transport unless ``settings`` say otherwise)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra = {
        "backend_name": "kvcr",
        "module_path": "kvcr.integrations.sglang",
        "class_name": "KvcrHiCacheStorage",
        "interface_v1": 1,
        "transport": "nixl",
        "control_port": port,
        "dram_bytes": "256MiB",
    }
    extra.update(settings)
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config=extra,
    )


def backend(host: Any, config: Any) -> Any:
    """Create and register the backend the way SGLang does: factory (dynamic route), then the pools."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    store = StorageBackendFactory.create_backend("dynamic", config, host)
    store.register_mem_pool_host(host)
    store.register_mem_host_pool_v2(host, "kv")
    store.on_host_pools_registered()
    return store
