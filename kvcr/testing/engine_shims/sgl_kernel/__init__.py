"""A stand-in for ``sgl_kernel`` on a CPU without its CPU build; only kvcr's launched test servers see it.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports CPU kernels from ``sgl_kernel`` when a module
loads, without checking that the CPU has AMX (``srt/mem_cache/allocation.py:45``,
``kernels/ops/kvcache/cache_move.py:9``; speculative decoding and a few layers import more names).
No CPU build of ``sgl_kernel`` is on the package index, so this package gives the two ops a plain
forward pass reaches, written in torch, and, for every other name, a function that raises
``NotImplementedError`` naming it when called (importing it succeeds, as importing the real package
does). With no AMX, SGLang's layers take their torch paths and never call those.

It lives in ``kvcr/testing/engine_shims``, which only the server processes ``kvcr.testing.engine``
starts get on ``PYTHONPATH``; a GPU deployment imports the real ``sgl_kernel``.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``allocation.py:746``: row ``req_pool_indices[i]``, columns ``[start, end)`` get the next slots."""
    del pool_len  # the row length; req_to_token's shape already says it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        count = int(end) - int(start)
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """``cache_move.py:191``: in each buffer (base address, row bytes), copy row ``src`` onto row ``tgt``."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for src, tgt in zip(src_loc.tolist(), tgt_loc.tolist(), strict=True):
            if src != tgt:
                ctypes.memmove(int(base) + int(tgt) * int(stride), int(base) + int(src) * int(stride), int(stride))


def _missing(name: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (kvcr/testing/engine_shims): this server path needs the real kernel"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a stand-in submodule (kvcacheio)
        return importlib.import_module(f"{__name__}.{name}")
    return _missing(name)
