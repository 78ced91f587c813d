"""The runner's typed configuration (built once by the composition root or an integration)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcr.domain.deadlines import DeadlineBudget
from kvcr.domain.errors import ConfigError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.keys import NamespaceSpec, PoolGeometry
from kvcr.domain.pools import PoolSpec, check_pool_set

DEFAULT_BUDGET = DeadlineBudget(operation_s=5.0, abandon_s=10.0)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What one runner (one engine rank) holds and how long it may take.

    ``dram_bytes`` is split across physical pools in proportion to their page size, so every
    pool gets the same number of slots; ``pool_dram_bytes`` overrides a pool's share.
    """

    name: str
    namespace: NamespaceSpec
    pools: tuple[PoolSpec, ...]
    dram_bytes: int
    pool_dram_bytes: Mapping[str, int] = field(default_factory=dict)
    policy: str = "lru"
    budget: DeadlineBudget = DEFAULT_BUDGET
    lease_s: float = 10.0
    lease_margin_s: float = 0.5
    max_alignment_depth: int = 4096

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("runner name must not be empty")
        check_pool_set(self.pools)
        if self.dram_bytes <= 0:
            raise ConfigError(f"dram_bytes must be positive, got {self.dram_bytes}")
        names = {p.name for p in self.pools}
        for pool in self.pool_dram_bytes:
            if pool not in names:
                raise ConfigError(f"pool_dram_bytes names unknown pool {pool!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.lease_s <= 0 or not 0 <= self.lease_margin_s < self.lease_s:
            raise ConfigError(
                f"lease_ms must be positive and larger than the margin, got {self.lease_s * 1000:g} "
                f"and margin {self.lease_margin_s * 1000:g}"
            )
        geometry = {g.pool: g.piece_bytes for g in self.namespace.pools}
        for spec in self.pools:
            if spec.physical and geometry.get(spec.name) != tuple(c.piece_bytes for c in spec.components):
                raise ConfigError(f"namespace geometry does not match pool {spec.name!r}")

    def slots_per_pool(self) -> dict[str, int]:
        """Slots each physical pool's arena holds."""
        physical = [p for p in self.pools if p.physical]
        explicit = {p: n for p, n in self.pool_dram_bytes.items()}
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


def namespace_for(
    model: str,
    page_size: int,
    dtype: str,
    layout: str,
    pools: tuple[PoolSpec, ...],
    **identity: object,
) -> NamespaceSpec:
    """A NamespaceSpec whose geometry is taken from ``pools`` (so the two cannot disagree)."""
    geometry = tuple(PoolGeometry(p.name, tuple(c.piece_bytes for c in p.components)) for p in pools if p.physical)
    return NamespaceSpec(model, page_size, dtype, layout, geometry, **identity)  # type: ignore[arg-type]
