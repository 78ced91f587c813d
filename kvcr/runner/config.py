"""The runner's typed configuration (built once by the composition root or an integration)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcr.domain.deadlines import Timing
from kvcr.domain.digests import PAGE_DIGEST_NAMES, PageDigest
from kvcr.domain.errors import ConfigError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.keys import NamespaceSpec
from kvcr.domain.pools import PoolSpec, check_pool_set

MAX_DRAM_BYTES = 1 << 50  # 1 PiB: anything larger is a typo, not a machine


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What one runner (one engine rank) holds and how long it may take.

    ``dram_bytes`` is split across physical pools in proportion to their page size, so every
    pool gets the same number of slots; ``pool_dram_bytes`` overrides a pool's share.
    ``verify_bytes``: every page gets a digest bound to its key when it is backed up, and every
    restore (local or from a peer) checks the bytes it delivered against it; a mismatch is a
    miss. ``page_digest`` names the digest (:mod:`kvcr.domain.digests`): every replica that reads
    from another must use the same one. ``max_leased_fraction`` bounds how much of a pool peers'
    leases may pin at once, so the owner's own backups always find slots;
    ``max_peer_leased_fraction`` bounds the share of that cap one peer (one control connection)
    may pin, and ``max_peer_leases`` its live leases, so one peer cannot starve another's
    restore (:mod:`kvcr.runner.quota`).
    """

    name: str
    namespace: NamespaceSpec
    pools: tuple[PoolSpec, ...]
    dram_bytes: int
    pool_dram_bytes: Mapping[str, int] = field(default_factory=dict)
    policy: str = "lru"
    timing: Timing = field(default_factory=Timing)
    verify_bytes: bool = True
    page_digest: str = PageDigest.XXH3.value
    max_leased_fraction: float = 0.5
    max_peer_leased_fraction: float = 0.5
    max_peer_leases: int = 1024
    max_alignment_depth: int = 4096

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("runner name must not be empty")
        check_pool_set(self.pools)
        if not 0 < self.dram_bytes <= MAX_DRAM_BYTES:
            raise ConfigError(f"dram_bytes must be in 1..{MAX_DRAM_BYTES} (1 PiB), got {self.dram_bytes}")
        names = {p.name for p in self.pools}
        for pool in self.pool_dram_bytes:
            if pool not in names:
                raise ConfigError(f"pool_dram_bytes names unknown pool {pool!r}")
        if self.page_digest not in PAGE_DIGEST_NAMES:
            raise ConfigError(f"page_digest must be one of {', '.join(PAGE_DIGEST_NAMES)}, got {self.page_digest!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if not 0 < self.max_leased_fraction <= 1:
            raise ConfigError(f"max_leased_fraction must be in (0, 1], got {self.max_leased_fraction}")
        if not 0 < self.max_peer_leased_fraction <= 1:
            raise ConfigError(f"max_peer_leased_fraction must be in (0, 1], got {self.max_peer_leased_fraction}")
        if not 0 < self.max_peer_leases <= 1 << 20:
            raise ConfigError(f"max_peer_leases must be in 1..{1 << 20}, got {self.max_peer_leases}")

    def namespaces(self) -> dict[str, str]:
        """The namespace digest of every physical pool (what HELLO compares)."""
        return {
            p.name: self.namespace.pool_digest(p.name, [c.piece_bytes for c in p.components], p.shard)
            for p in self.pools
            if p.physical
        }

    def slots_per_pool(self) -> dict[str, int]:
        """Slots each physical pool's arena holds."""
        physical = [p for p in self.pools if p.physical]
        explicit = dict(self.pool_dram_bytes)
        shared_pools = [p for p in physical if p.name not in explicit]
        shared_bytes = self.dram_bytes - sum(explicit.values())
        if shared_pools and shared_bytes <= 0:
            raise ConfigError("pool_dram_bytes leaves no dram_bytes for the other pools")
        per_page = sum(p.page_bytes for p in shared_pools)
        slots: dict[str, int] = {}
        for pool in physical:
            count = explicit[pool.name] // pool.page_bytes if pool.name in explicit else shared_bytes // per_page
            if count < 1:
                raise ConfigError(
                    f"dram for pool {pool.name!r} holds no page of {pool.page_bytes} bytes; raise dram_bytes"
                )
            slots[pool.name] = count
        return slots
