"""Smoke test of an installed kvcr-runner wheel inside an SGLang 0.5.23 environment.

Run by ``scripts/wheel_smoke.sh`` with the throwaway venv's interpreter (``python -I``, outside the
checkout), so everything imported is what the wheel installed. Checks, in order: the package comes
from the wheel; kvcr.compat finds a supported environment; SGLang's own plugin loader finds kvcr's
entry point and applies its hooks; SGLang's storage factory loads kvcr through the ``dynamic`` route,
and one page backed up from SGLang's real host pool comes back byte for byte (NIXL transport, peer
service on loopback). Prints one line per check; exits 1 if any failed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import socket
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
PAGE = 16


def installed_from_the_wheel() -> str:
    import kvcr

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(kvcr.__file__).resolve()
    assert where.is_relative_to(site), f"kvcr imported from {where}, not from {site}"
    dist = md.distribution("kvcr-runner")
    direct_url = dist.read_text("direct_url.json")
    assert direct_url is None or '"editable": true' not in direct_url
    from kvcr.adapters.shm import copies, dataplane

    # built where a C compiler is (CI's machines): the optional extensions must be in the wheel
    assert copies.stream_copy is not None, "the wheel lacks kvcr.adapters.shm._stream (streaming copies)"
    assert dataplane._board_reader is not None, "the wheel lacks kvcr.adapters.shm._board (slot-board reads)"
    return f"kvcr-runner {dist.version} from {where.parent}, with its streaming-copy and slot-board extensions"


def compat_finds_a_supported_environment() -> str:
    from kvcr import compat

    found = compat.ensure_supported("sglang", "nixl", environ={})
    base = compat.check_base_dependencies()
    assert base.ok, base.line
    return "; ".join(f.found for f in found)


def sglang_loads_the_plugin() -> str:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins

    (entry,) = [ep for ep in md.entry_points(group=GENERAL_PLUGINS_GROUP) if ep.name == "kvcr"]
    assert entry.value == "kvcr.integrations.sglang.plugin:load", entry.value
    assert entry.dist is not None and entry.dist.name.replace("_", "-") == "kvcr-runner", entry.dist
    load_plugins()  # SGLang's loader: discovers, runs kvcr's load(), then applies the hooks
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.managers.scheduler import Scheduler

    from kvcr.integrations.sglang import plugin

    assert plugin._loaded
    for method in (Scheduler._prefetch_kvcache, HiCacheController._page_backup, HiCacheController._page_transfer):
        assert hasattr(method, "__wrapped__"), f"{method.__qualname__} was not hooked"
    return f"{GENERAL_PLUGINS_GROUP}: {entry.name} = {entry.value}; hooks applied"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_pool(layers: int = 2, heads: int = 2, head_dim: int = 8, pages: int = 4) -> Any:
    """SGLang's real MHA host pool on the CPU (bf16, page_first), ``pages`` pages of ``PAGE`` tokens."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(PAGE, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(PAGE, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    buffers = KVBuffers(
        k=k,
        v=v,
        k_data_ptrs=make_kernel_ptr_table(list(k), "cpu", host_memory_registered=False),
        v_data_ptrs=make_kernel_ptr_table(list(v), "cpu", host_memory_registered=False),
        layout=KVBufferLayout.NHD,
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=PAGE,
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
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=PAGE,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=pages * PAGE,
    )


def one_page_round_trip() -> str:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    host = host_pool()
    extra = {  # the keys an operator puts in --hicache-storage-backend-extra-config
        "backend_name": "kvcr",
        "module_path": "kvcr.integrations.sglang",
        "class_name": "KvcrHiCacheStorage",
        "interface_v1": 1,
        "transport": "nixl",
        "control_host": "127.0.0.1",
        "control_port": free_port(),
        "dram_bytes": "4MiB",
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="smoke",
        extra_config=extra,
    )
    store = StorageBackendFactory.create_backend("dynamic", config, host)
    assert type(store).__module__.startswith("kvcr."), type(store)
    try:
        store.register_mem_pool_host(host)
        store.register_mem_host_pool_v2(host, "kv")
        store.on_host_pools_registered()
        bits = host.kv_buffer.view(torch.int16)
        source = torch.arange(0, PAGE, dtype=torch.int64)
        target = torch.arange(2 * PAGE, 3 * PAGE, dtype=torch.int64)
        bits[:, :PAGE].random_()
        keys = get_hash_str(list(range(100, 100 + PAGE)), None, page_size=PAGE)
        assert store.batch_set_v1(keys, source) == [True]
        assert store.batch_exists(keys) == 1
        assert store.batch_get_v1(keys, target) == [True]
        assert torch.equal(bits[:, :PAGE], bits[:, 2 * PAGE : 3 * PAGE]), "the restored page differs"
        assert bits[:, :PAGE].any(), "the page was empty: the comparison proves nothing"
    finally:
        store.close()
    return f"{type(store).__name__} via 'dynamic'; 1 page of {2 * 2 * 2 * 8 * 2 * PAGE} B backed up and restored"


CHECKS: list[Callable[[], str]] = [
    installed_from_the_wheel,
    compat_finds_a_supported_environment,
    sglang_loads_the_plugin,
    one_page_round_trip,
]


def main() -> int:
    failed = 0
    for check in CHECKS:
        try:
            print(f"  ok    {check.__name__}: {check()}", flush=True)
        except Exception:
            failed += 1
            print(f"  FAIL  {check.__name__}:\n{traceback.format_exc()}", flush=True)
    print(f"wheel smoke: {len(CHECKS) - failed} of {len(CHECKS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
