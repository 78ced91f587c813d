"""The hit rule: how many leading pages of a query every pool can restore, and at which lengths.

A query names one or more pools with, per page, whether the page is available (held locally or
leased from a peer). Physical ALL_PAGES pools are the evidence: a page counts only when each of
them has it, so the anchor prefix is the shortest of their leading runs. TRAILING_PAGES pools
(Mamba / SWA checkpoints) only need their window complete at the cut. The legal cuts are the
intersection of every pool's resume boundaries inside the anchor prefix; the hit is the largest.
A query whose pools hold no bytes under ALL_PAGES (a bare logical anchor) has no evidence at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcr.domain.boundaries import all_pages_boundaries, intersect, leading_run, trailing_boundaries
from kvcr.domain.errors import EvidenceError, LayoutError
from kvcr.domain.pools import HitPolicy


@dataclass(frozen=True, slots=True)
class PoolPresence:
    """One pool's answer to a query: its policy, trailing window, and per-page availability."""

    pool: str
    policy: HitPolicy
    present: Sequence[bool]
    window: int = 1
    physical: bool = True


@dataclass(frozen=True, slots=True)
class HitVerdict:
    """The longest restorable prefix, each pool's own hit, and every legal cut (0 excluded)."""

    pages: int
    pool_hits: dict[str, int]
    restorable: tuple[int, ...]


def evidence_pools(pools: Sequence[PoolPresence]) -> list[PoolPresence]:
    """The physical ALL_PAGES pools; EvidenceError when there are none (a bare logical anchor)."""
    required = [p for p in pools if p.physical and p.policy is HitPolicy.ALL_PAGES]
    if not required:
        raise EvidenceError("query names no physical all_pages pool; a logical anchor alone is no evidence")
    return required


def anchor_prefix(pools: Sequence[PoolPresence]) -> int:
    """Pages every evidence pool holds, from the first one."""
    return min(leading_run(p.present) for p in evidence_pools(pools))


def hit_verdict(pools: Sequence[PoolPresence]) -> HitVerdict:
    """Apply the hit rule (module docstring). Raises EvidenceError for a bare logical anchor."""
    lengths = {len(p.present) for p in pools if p.physical}
    if len(lengths) > 1:
        raise LayoutError(f"pools report different page counts for one query: {sorted(lengths)}")
    prefix = anchor_prefix(pools)
    sets = []
    hits: dict[str, int] = {}
    for pool in pools:
        if not pool.physical:
            continue
        if pool.policy is HitPolicy.ALL_PAGES:
            sets.append(all_pages_boundaries(pool.present[:prefix]))
            hits[pool.pool] = leading_run(pool.present)
        else:
            boundaries = trailing_boundaries(pool.present[:prefix], pool.window)
            sets.append(boundaries)
            hits[pool.pool] = max(boundaries)
    restorable = tuple(sorted(intersect(sets) - {0}))
    return HitVerdict(restorable[-1] if restorable else 0, hits, restorable)
