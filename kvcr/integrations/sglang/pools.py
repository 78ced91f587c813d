"""Turn SGLang host pools into kvcr pool specs and host regions (torch stays on this side).

A host pool's page is addressed through ``get_page_buffer_meta``: for ``page_first`` and
``page_first_direct`` every page has one extent per component (MHA: K then V; MLA: one), each
component's extents ``stride`` bytes apart. We probe pages 0, 1 and the last page once at
registration and refuse anything that is not such a strided layout with a message naming why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcr.domain.errors import LayoutError
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import HitPolicy, PoolSpec

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")


@dataclass(frozen=True, slots=True)
class DescribedPool:
    """A kvcr pool spec for an SGLang host pool, where its pages live, and its token geometry."""

    spec: PoolSpec
    regions: tuple[RegionDescriptor, ...]
    page_size: int
    dtype: str
    layout: str


def _torch() -> Any:
    import torch

    return torch


def describe_host_pool(name: str, pool: Any, *, anchor: bool, hit_policy: HitPolicy) -> DescribedPool:
    """Probe ``pool`` and describe it; raise LayoutError when kvcr cannot address it zero-copy."""
    layout = getattr(pool, "layout", None)
    page_size = int(getattr(pool, "page_size", 0) or 0)
    dtype = str(getattr(pool, "dtype", "unknown"))
    if page_size <= 0:
        raise LayoutError(f"host pool {name!r} has no page_size")
    if anchor and getattr(pool, "kv_buffer", object()) is None:
        # A logical anchor (DeepSeek-V4): it orders pages and slots but holds no bytes.
        return DescribedPool(PoolSpec(name, (), anchor=True, logical=True), (), page_size, dtype, str(layout))
    if layout not in SUPPORTED_LAYOUTS:
        raise LayoutError(
            f"host pool {name!r} uses layout {layout!r}; kvcr needs --hicache-mem-layout page_first or "
            "page_first_direct (layer_first scatters a page over every layer, which kvcr does not copy)"
        )
    pages = _page_count(pool, page_size)
    if pages < 2:
        raise LayoutError(f"host pool {name!r} has {pages} pages; kvcr needs at least 2")
    torch = _torch()
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * page_size, dtype=torch.int64))
    if not ptrs or len(ptrs) % 2 or len(ptrs) != len(sizes):
        raise LayoutError(f"host pool {name!r}: page meta has {len(ptrs)} extents for 2 pages")
    k = len(ptrs) // 2
    last_ptrs, last_sizes = pool.get_page_buffer_meta(
        torch.arange((pages - 1) * page_size, pages * page_size, dtype=torch.int64)
    )
    components = []
    regions = []
    for c in range(k):
        base, size, stride = int(ptrs[c]), int(sizes[c]), int(ptrs[k + c]) - int(ptrs[c])
        if int(sizes[k + c]) != size or int(last_sizes[c]) != size:
            raise LayoutError(f"host pool {name!r} component {c}: pieces differ in size between pages")
        if stride < size:
            raise LayoutError(f"host pool {name!r} component {c}: pages overlap (stride {stride} < piece {size})")
        if int(last_ptrs[c]) != base + (pages - 1) * stride:
            raise LayoutError(f"host pool {name!r} component {c}: pages are not evenly strided")
        label = f"c{c}"
        components.append(ComponentSpec(label, size))
        regions.append(RegionDescriptor(f"{name}/{label}", base, stride, pages, size))
    spec = PoolSpec(name, tuple(components), hit_policy, anchor=anchor)
    return DescribedPool(spec, tuple(regions), page_size, dtype, str(layout))


def _page_count(pool: Any, page_size: int) -> int:
    page_num = getattr(pool, "page_num", None)
    if isinstance(page_num, int) and page_num > 0:
        return page_num
    return int(getattr(pool, "size", 0)) // page_size


def host_slots(host_indices: Any, page_size: int) -> list[int]:
    """Page slots of a tensor of token indices; pages must be whole, aligned and contiguous."""
    torch = _torch()
    indices = host_indices.to(device="cpu", dtype=torch.int64).reshape(-1)
    if indices.numel() % page_size:
        raise LayoutError(f"{indices.numel()} host indices are not a whole number of {page_size}-token pages")
    pages = indices.view(-1, page_size)
    starts = pages[:, :1]
    if bool((starts % page_size).any()):
        raise LayoutError("host indices are not aligned to pages")
    if page_size > 1 and not bool((pages - starts == torch.arange(page_size, dtype=torch.int64)).all()):
        raise LayoutError("host indices of a page are not contiguous")
    return (starts.reshape(-1) // page_size).tolist()  # type: ignore[no-any-return]
