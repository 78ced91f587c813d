"""Memory layouts: registered regions, and runs of pieces between them.

A pool's page is made of one *piece* per physical *component* (MHA: K and V; MLA: one latent).
Each component lives in a registered :class:`RegionDescriptor` — ``count`` pieces of
``piece_bytes``, ``stride`` bytes apart from ``base`` — and a page's piece is addressed by its
slot (element index), so no raw pointer crosses a layer boundary. Batched IO turns
(source slot, destination slot) pairs into :class:`PieceRun` s with one coalescer, merging pairs
that are adjacent on both sides.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcr.domain.errors import LayoutError


class Pieces(Protocol):
    """What a run is checked against: a region's piece count and size (a descriptor or its wire form)."""

    @property
    def count(self) -> int: ...

    @property
    def piece_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """A physical component of a pool: its label and the bytes of one page's piece."""

    label: str
    piece_bytes: int

    def __post_init__(self) -> None:
        if not self.label:
            raise LayoutError("component label must not be empty")
        if self.piece_bytes <= 0:
            raise LayoutError(f"component {self.label!r}: piece_bytes must be positive, got {self.piece_bytes}")


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """``count`` pieces of ``piece_bytes`` each, ``stride`` bytes apart, starting at ``base``."""

    label: str
    base: int
    stride: int
    count: int
    piece_bytes: int

    def __post_init__(self) -> None:
        if not self.label:
            raise LayoutError("region label must not be empty")
        if self.base < 0:
            raise LayoutError(f"region {self.label!r}: base must not be negative")
        if self.piece_bytes <= 0:
            raise LayoutError(f"region {self.label!r}: piece_bytes must be positive, got {self.piece_bytes}")
        if self.count <= 0:
            raise LayoutError(f"region {self.label!r}: count must be positive, got {self.count}")
        if self.count > 1 and self.stride < self.piece_bytes:
            raise LayoutError(
                f"region {self.label!r}: stride {self.stride} is smaller than piece_bytes "
                f"{self.piece_bytes}, so its own pieces overlap"
            )

    @property
    def span(self) -> int:
        """Bytes from ``base`` to the end of the last piece."""
        return self.stride * (self.count - 1) + self.piece_bytes

    @property
    def dense(self) -> bool:
        """Whether consecutive pieces touch (a run of them is one extent)."""
        return self.count == 1 or self.stride == self.piece_bytes

    def offset(self, index: int) -> int:
        """Byte offset of piece ``index`` from ``base``."""
        if not 0 <= index < self.count:
            raise LayoutError(f"region {self.label!r}: index {index} is outside [0, {self.count})")
        return index * self.stride

    def address(self, index: int) -> int:
        """Absolute address of piece ``index``."""
        return self.base + self.offset(index)

    def overlaps(self, other: RegionDescriptor) -> bool:
        """Whether any piece of ``self`` shares a byte with any piece of ``other``."""
        lo, hi = max(self.base, other.base), min(self.base + self.span, other.base + other.span)
        if lo >= hi:
            return False
        if self.count == 1 and other.count == 1:
            return True
        if self.stride == other.stride and self.stride > 0:
            # Two progressions with one period: compare the pieces' phases inside a period.
            period = self.stride
            phase = (other.base - self.base) % period
            a_hits_b = phase < self.piece_bytes
            b_hits_a = phase + other.piece_bytes > period
            return a_hits_b or b_hits_a
        return True  # different periods over a shared extent: refuse rather than prove


def check_disjoint(regions: Sequence[RegionDescriptor]) -> None:
    """Raise LayoutError naming the first pair of regions that overlap or share a label."""
    seen: dict[str, RegionDescriptor] = {}
    for region in regions:
        if region.label in seen:
            raise LayoutError(f"region label {region.label!r} is registered twice")
        seen[region.label] = region
    ordered = sorted(regions, key=lambda r: r.base)
    for i, region in enumerate(ordered):
        for other in ordered[i + 1 :]:
            if other.base >= region.base + region.span:
                break
            if region.overlaps(other):
                raise LayoutError(f"regions {region.label!r} and {other.label!r} overlap")


@dataclass(frozen=True, slots=True)
class PieceRun:
    """``count`` consecutive pieces: region ``src`` from piece ``src_first`` into region ``dst`` from ``dst_first``.

    Regions are named by the ids a data plane gave them at registration (``src`` is the peer's,
    ``dst`` ours for a remote read); pieces by their index inside the region.
    """

    src: int
    src_first: int
    dst: int
    dst_first: int
    count: int = 1

    def misfit(self, src: Pieces, dst: Pieces) -> str | None:
        """Why this run cannot move between ``src`` and ``dst`` (other piece sizes, out of bounds), or None."""
        if src.piece_bytes != dst.piece_bytes:
            return f"run {self}: piece sizes differ ({src.piece_bytes} vs {dst.piece_bytes})"
        if (
            self.count <= 0
            or self.src_first < 0
            or self.dst_first < 0
            or self.src_first + self.count > src.count
            or self.dst_first + self.count > dst.count
        ):
            return f"run {self} is out of the registered bounds"
        return None


def page_extents(regions: Sequence[RegionDescriptor], slot: int) -> list[tuple[int, int]]:
    """(address, bytes) of every component piece of page ``slot``: one per region, in component order."""
    return [(r.base + slot * r.stride, r.piece_bytes) for r in regions]


def slot_runs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src slot, dst slot) pairs into (src first, dst first, count) runs.

    The one coalescer of the data path: pairs are ordered by destination and a pair joins the
    previous run when it continues it on both sides. Every component of a pool shares its slot
    numbering, so one call serves all of a pool's components.
    """
    ordered = sorted(pairs, key=_by_destination)
    if not ordered:
        return []
    first_src, first_dst = ordered[0]
    if all(src == first_src + k and dst == first_dst + k for k, (src, dst) in enumerate(ordered)):
        return [(first_src, first_dst, len(ordered))]  # the common case: one run on both sides
    runs: list[tuple[int, int, int]] = []
    run_src, run_dst, run_len = first_src, first_dst, 0
    for src, dst in ordered:
        if src == run_src + run_len and dst == run_dst + run_len:
            run_len += 1
            continue
        runs.append((run_src, run_dst, run_len))
        run_src, run_dst, run_len = src, dst, 1
    runs.append((run_src, run_dst, run_len))
    return runs


_by_destination = operator.itemgetter(1)
