"""CPU shims for a real SGLang 0.5.23 server, loaded only by the server processes kvcr's harness starts.

``kvcr.testing.engine`` puts this directory first on the launched server's ``PYTHONPATH`` (and on
nobody else's): Python imports ``sitecustomize`` at start-up in that process and in every process it
spawns (SGLang's scheduler and detokenizer inherit the environment). kvcr never imports this module,
and it is not in the wheel (the directory has no ``__init__.py``). Every patch below is applied right
after SGLang's own module has executed (an import hook), and only when torch has no CUDA device, so
a GPU deployment, which never sees this directory, is unaffected either way.

What each shim stands in for (paths inside the ``sglang`` package):

* ``srt/mem_cache/pool_host/base.py`` ``HostKVCache.__init__``: host pools pin their memory by
  default (``pool_host/mha.py:143``). Pinning calls ``cudaHostRegister``
  (``pool_host/common.py:349`` -> ``:147``), which fails at start-up without CUDA, and
  ``pool_host/mha.py:728`` allocates pinned pages on every L3 read. The shim passes
  ``pin_memory=False`` when ``torch.cuda.is_available()`` is false.
* ``srt/mem_cache/pool_host/mha.py:59-89``: the ``--hicache-io-backend direct`` copies
  (``transfer_kv_direct``, ``transfer_kv_per_layer_direct_pf_lf``,
  ``transfer_kv_all_layer_direct_lf_pf``) are bound only for CUDA, HIP and XPU. The shim binds torch
  versions (``sgl_kernel/kvcacheio.py`` here) when the module has none.
* ``sgl_kernel`` (the directory next to this file): with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports
  CPU kernels from ``sgl_kernel`` at module load without checking for AMX
  (``srt/mem_cache/allocation.py:45``, ``kernels/ops/kvcache/cache_move.py:9``, speculative
  decoding). No CPU build of ``sgl_kernel`` is published, so a stand-in package provides the two ops
  a plain forward pass reaches, in torch, and names that raise for everything else.

``KVCR_ENGINE_HOST_RESERVE_GIB=<GiB>``: SGLang refuses a HiCache host pool larger than the host's
available memory less a fixed 10 GiB reserve (``srt/mem_cache/pool_host/base.py``), sized for
machines with hundreds of GiB; several servers of a real model on a 24 GiB test machine need a
smaller one. Only the launched process reads it; unset, SGLang's reserve stands.

Two test-only controls around SGLang's L3 read, ``HiCacheController._page_get_zero_copy``
(``srt/managers/cache_controller.py:1113``, which calls the backend's ``batch_get_v1``), off unless
their variable is set. Neither touches kvcr:

* ``KVCR_ENGINE_CORRUPT_FLAG=<path>``: while that file exists, the pages kvcr restored into the host
  pool are overwritten with noise after the read returns, so a test can show that its check of a
  restored answer can fail (and, once the file is gone, that the same restore is then right). A file
  holding a number ``N`` limits that to ``N`` pages of each read, from the middle of what it restored.
* ``KVCR_ENGINE_READ_DELAY_S=<seconds>``: the read starts that much later. The hit query has already
  leased a hinted source's pages by then, so a test can freeze or kill the source between the lease
  and the read (while this replica restores).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

CORRUPT_ENV = "KVCR_ENGINE_CORRUPT_FLAG"
DELAY_ENV = "KVCR_ENGINE_READ_DELAY_S"
RESERVE_ENV = "KVCR_ENGINE_HOST_RESERVE_GIB"


def _no_accelerator() -> bool:
    import torch

    return not torch.cuda.is_available()


def _unpinned_host_pools(module: types.ModuleType) -> None:
    reserve_gib = os.environ.get(RESERVE_ENV)
    if reserve_gib and hasattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES"):
        setattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES", int(float(reserve_gib) * (1 << 30)))  # noqa: B010
    cls = module.HostKVCache
    original = cls.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _no_accelerator():
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["pin_memory"] = False
            args, kwargs = tuple(bound.args[1:]), dict(bound.kwargs)
        original(self, *args, **kwargs)

    cls.__init__ = __init__


def _direct_io(module: types.ModuleType) -> None:
    if not _no_accelerator():
        return
    import importlib

    kvcacheio = importlib.import_module("sgl_kernel.kvcacheio")

    for name in ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"):
        if not hasattr(module, name):
            setattr(module, name, getattr(kvcacheio, name))


def _read_controls(module: types.ModuleType) -> None:
    flag = os.environ.get(CORRUPT_ENV)
    delay_s = float(os.environ.get(DELAY_ENV) or 0)
    if not flag and delay_s <= 0:
        return
    cls = module.HiCacheController
    original = cls._page_get_zero_copy

    @functools.wraps(original)
    def _page_get_zero_copy(self: Any, operation: Any, hash_values: Any, host_indices: Any, *args: Any) -> int:
        if delay_s > 0:
            time.sleep(delay_s)
        restored = int(original(self, operation, hash_values, host_indices, *args))
        if restored and flag and os.path.exists(flag):
            import torch

            group = self.mem_pool_host  # a HostPoolGroup under the unified radix cache: its anchor is the KV pool
            pool = group.anchor_entry.host_pool if hasattr(group, "anchor_entry") else group
            tokens = host_indices[: restored * pool.page_size].to(torch.int64)
            gen = torch.Generator().manual_seed(restored)
            pages = torch.unique(torch.div(tokens, pool.page_size, rounding_mode="floor")).tolist()
            limit = _corrupt_limit(flag)
            if limit:  # only that many pages, from the middle of what this read restored
                pages = pages[len(pages) // 2 :][:limit]
            for page in pages:
                view = pool.get_data_page(int(page) * pool.page_size, flat=False)
                view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype) * 4)
        return restored

    cls._page_get_zero_copy = _page_get_zero_copy


def _corrupt_limit(flag: str) -> int:
    """The page count the flag file names (0, empty or unreadable: every restored page)."""
    try:
        with open(flag) as handle:
            return max(0, int(handle.read().strip() or 0))
    except (OSError, ValueError):
        return 0


# Names SGLang probes with hasattr(torch.ops.sgl_kernel, ...) to choose a CPU kernel: they must stay
# missing, or SGLang would pick kernels that do not exist here.
_PROBED_OPS = frozenset(
    {
        "convert_weight_packed",
        "fused_qk_norm_cpu",
        "fused_qk_norm_rope_cpu",
        "gdn_attention",
        "get_device_accessible_ptr",
        "shm_group_initialize",
    }
)


def _cpu_op_placeholders(module: types.ModuleType) -> None:
    """``torch.ops.sgl_kernel.<name>_cpu`` read at import gives a function that raises when called.

    Only with ``KVCR_ENGINE_CPU_OP_PLACEHOLDERS=1`` (the ``dynamo.sglang`` harness sets it): Dynamo's
    worker imports SGLang's Qwen3.5 model (``srt/models/qwen3_5.py:284``, ``:292``, ...), which binds
    ``sgl_kernel`` CPU ops at import. Only ``*_cpu`` names outside the probed set get one (other
    probes, such as ``register_fake_if_exists`` for GPU ops, must keep failing), and only while
    torch sees no CUDA device. The tiny Llama never calls them.
    """
    namespace = module._OpNamespace
    original = namespace.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        try:
            return original(self, name)
        except AttributeError:
            if self.name != "sgl_kernel" or not name.endswith("_cpu") or name in _PROBED_OPS or not _no_accelerator():
                raise

            def placeholder(*args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError(f"torch.ops.sgl_kernel.{name} is a placeholder of kvcr's CPU shims")

            return placeholder

    namespace.__getattr__ = __getattr__


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _unpinned_host_pools,
    "sglang.srt.mem_cache.pool_host.mha": _direct_io,
    "sglang.srt.managers.cache_controller": _read_controls,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]) -> None:
        self._inner, self._patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds SGLang's modules the normal way, then patches them once they have executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


if os.environ.get("KVCR_ENGINE_CPU_OP_PLACEHOLDERS") == "1":
    _PATCHES["torch._ops"] = _cpu_op_placeholders

if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchingFinder())
