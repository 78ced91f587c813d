"""Pools, their hit policies, and the evidence rule.

A host pool group has one *anchor* pool (``kv``) that defines the page chain and host slots,
possibly *logical* (no bytes, as in DeepSeek-V4), plus side pools (indexer, mamba, swa, ...).
ALL_PAGES pools need every page of a prefix; TRAILING_PAGES pools need only a trailing window
(Mamba/SWA checkpoints). A page counts as present only when every physical piece of every
required pool is present; a question about a logical anchor alone has no evidence at all
(the hit rule itself is :mod:`kvcr.domain.hits`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvcr.domain.errors import LayoutError
from kvcr.domain.keys import ShardIdentity, check_pool_name
from kvcr.domain.layout import ComponentSpec

_UNSHARDED = ShardIdentity()


class HitPolicy(str, enum.Enum):
    """How a pool's pages must be present for a prefix to be restorable."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool's name, physical components, hit policy, whether it is the (logical) anchor, its shard.

    ``shard`` is this rank's slice of the pool's bytes: replicated for MLA KV (one key space
    across TP ranks), the TP rank for sharded pools; it is part of the pool's namespace.
    """

    name: str
    components: tuple[ComponentSpec, ...]
    hit_policy: HitPolicy = HitPolicy.ALL_PAGES
    anchor: bool = False
    logical: bool = False
    shard: ShardIdentity = _UNSHARDED

    def __post_init__(self) -> None:
        check_pool_name(self.name)
        if self.logical:
            if self.components:
                raise LayoutError(f"pool {self.name!r} is logical and must have no components")
            if not self.anchor:
                raise LayoutError(f"pool {self.name!r}: only the anchor pool may be logical")
        elif not self.components:
            raise LayoutError(f"pool {self.name!r} has zero components")
        labels = [c.label for c in self.components]
        if len(set(labels)) != len(labels):
            raise LayoutError(f"pool {self.name!r} repeats a component label: {labels}")
        if self.anchor and self.hit_policy is not HitPolicy.ALL_PAGES:
            raise LayoutError(f"anchor pool {self.name!r} must use the all_pages hit policy")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every component (0 for a logical pool)."""
        return sum(c.piece_bytes for c in self.components)

    @property
    def physical(self) -> bool:
        """Whether the pool holds bytes."""
        return not self.logical


def check_pool_set(pools: Sequence[PoolSpec]) -> None:
    """Raise LayoutError unless pool names are unique and at most one pool is the anchor."""
    names = [p.name for p in pools]
    if not pools:
        raise LayoutError("at least one pool is required")
    if len(set(names)) != len(names):
        raise LayoutError(f"pool names repeat: {names}")
    anchors = [p.name for p in pools if p.anchor]
    if len(anchors) > 1:
        raise LayoutError(f"only one pool may be the anchor, got {anchors}")
