"""Torch versions of SGLang's three ``--hicache-io-backend direct`` copies (``pool_host/mha.py:59-89``).

SGLang binds them from ``sgl_kernel.kvcacheio`` only for CUDA and HIP (and its own XPU module);
kvcr's launched CPU servers get these through ``sitecustomize``. Indices are token slots; a host
``page_first_direct`` buffer is ``[page, layer, token in page, head, dim]`` per K and V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _missing


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``layer_first``: token rows of each layer, source to destination."""
    del page_size  # whole pages or not, a row copy is the same
    src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    for source, target in zip(src_layers, dst_layers, strict=True):
        target[dst] = source[src].to(target.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host ``page_first_direct`` -> device, one layer (K then V)."""
    src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    pages, offsets = torch.div(src, page_size, rounding_mode="floor"), src % page_size
    for host, device in zip(src_ptrs, dst_ptrs, strict=True):
        device[dst] = host[pages, layer_id, offsets].to(device.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device (every K layer, then every V layer) -> host ``page_first_direct``, all layers."""
    src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    pages, offsets = torch.div(dst, page_size, rounding_mode="floor"), dst % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for part, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[pages, layer, offsets] = src_ptrs[part * layers + layer][src].to(host.device)


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"kvcacheio.{name}")
