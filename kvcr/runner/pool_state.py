"""One pool as the runner holds it, and the geometry rules that tie its parts together.

A pool has a spec, an arena (none for a logical pool: it holds no bytes), the engine's host
regions once registered, a slot index and a namespace. The rules: host regions match the pool's
components piece for piece; a batch names one host slot per page, all inside the host pool; a
batch's copies are planned as one coalesced list of moves; a page's digest is bound to its
namespace, pool and key.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcr.domain.errors import LayoutError
from kvcr.domain.layout import RegionDescriptor, page_extents, slot_runs
from kvcr.domain.pools import PoolSpec
from kvcr.ports.memory import Move
from kvcr.runner.arena import Arena, host_label
from kvcr.runner.index import SlotIndex


class PoolState:
    """A pool's spec, arena, host regions, slot index and namespace. Guarded by the runner's lock."""

    __slots__ = ("arena", "host", "index", "namespace", "spec")

    def __init__(self, spec: PoolSpec, arena: Arena | None, index: SlotIndex, namespace: str) -> None:
        self.spec = spec
        self.arena = arena
        self.host: tuple[RegionDescriptor, ...] | None = None
        self.index = index
        self.namespace = namespace

    @property
    def name(self) -> str:
        return self.spec.name

    def arena_regions(self) -> tuple[RegionDescriptor, ...]:
        """The arena's regions, components in order (a physical pool's: the caller checked)."""
        assert self.arena is not None
        return self.arena.regions

    def host_regions(self) -> tuple[RegionDescriptor, ...]:
        """The registered host regions; LayoutError when the engine registered none yet."""
        host = self.host
        if host is None:
            raise LayoutError(f"pool {self.name!r} has no registered host regions")
        return host

    def canonical_host(self, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """``regions`` checked against the pool's components and renamed to kvcr's host labels."""
        pool, components = self.name, self.spec.components
        if len(regions) != len(components):
            raise LayoutError(f"pool {pool!r} has {len(components)} components, {len(regions)} host regions were given")
        canonical = []
        for region, component in zip(regions, components, strict=True):
            if region.piece_bytes != component.piece_bytes:
                raise LayoutError(
                    f"pool {pool!r} component {component.label!r}: host pieces are {region.piece_bytes} "
                    f"bytes, the pool expects {component.piece_bytes}"
                )
            canonical.append(
                RegionDescriptor(
                    host_label(pool, component.label), region.base, region.stride, region.count, region.piece_bytes
                )
            )
        return tuple(canonical)

    def check_batch(self, page_hashes: Sequence[str], host_slots: Sequence[int]) -> tuple[RegionDescriptor, ...]:
        """The host regions, after checking a batch names one host slot per page, each inside the host pool."""
        host = self.host_regions()
        if len(page_hashes) != len(host_slots):
            raise LayoutError(f"{len(page_hashes)} page hashes but {len(host_slots)} host slots")
        if host_slots:
            limit = host[0].count
            low, high = min(host_slots), max(host_slots)
            if low < 0 or high >= limit:
                raise LayoutError(f"host slot {low if low < 0 else high} is outside the host pool's {limit} pages")
        return host

    def seed(self, page_hash: str) -> bytes:
        """What a page's digest is bound to: its pool's namespace, the pool and the key."""
        return f"{self.namespace}#{self.name}#{page_hash}".encode()


def page_moves(
    dst_regions: Sequence[RegionDescriptor], dst_slot: int, src_regions: Sequence[RegionDescriptor], src_slot: int
) -> list[Move]:
    """One page's moves, one per component in component order (what its digest runs over)."""
    return [
        Move(dst, src, nbytes)
        for (dst, nbytes), (src, _) in zip(
            page_extents(dst_regions, dst_slot), page_extents(src_regions, src_slot), strict=True
        )
    ]


def merged_moves(
    dst_regions: Sequence[RegionDescriptor],
    src_regions: Sequence[RegionDescriptor],
    slot_pairs: Sequence[tuple[int, int]],
) -> list[Move]:
    """Merged moves for (dst slot, src slot) pairs across every component (one coalescing per pool)."""
    runs = slot_runs((src, dst) for dst, src in slot_pairs)
    moves: list[Move] = []
    for dst, src in zip(dst_regions, src_regions, strict=True):
        d_base, d_stride, s_base, s_stride, piece = dst.base, dst.stride, src.base, src.stride, dst.piece_bytes
        if dst.dense and src.dense:
            moves.extend(Move(d_base + d * d_stride, s_base + s * s_stride, n * piece) for s, d, n in runs)
        else:
            moves.extend(
                Move(d_base + (d + k) * d_stride, s_base + (s + k) * s_stride, piece)
                for s, d, n in runs
                for k in range(n)
            )
    return moves
