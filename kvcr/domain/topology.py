"""Where a rank's kvcr listens and whom it reads from: the one home of rank and port arithmetic.

An engine replica is ``tp_size * cp_size`` ranks; DP replica ``d`` owns the block of ports
``base + d * ranks_per_replica + [0, ranks_per_replica)``, rank offset ``tp_rank + tp_size *
cp_rank`` inside it. A hint names a replica's rank-0 control endpoint; rank ``r`` of the target
dials the source's port ``+ r``.

Replicated KV (MLA) is byte-identical on every TP rank, so only the storage writer (TP rank 0
of the CP group) backs it up and every other rank reads it from that writer: locally from its
own replica's writer, remotely from the hinted replica's writer. TP-sharded pools (Mamba state
next to MLA KV) are backed up by every rank and read from the same rank of the source replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import ShardIdentity

MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class RankLayout:
    """One rank's place in its engine: TP and attention-CP coordinates, its DP replica."""

    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.cp_size < 1 or not 0 <= self.cp_rank < self.cp_size:
            raise ConfigError(f"attn_cp_rank {self.cp_rank} is outside attn_cp_size {self.cp_size}")
        if self.dp_rank < 0:
            raise ConfigError(f"dp_rank must not be negative, got {self.dp_rank}")

    @property
    def ranks_per_replica(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def rank_offset(self) -> int:
        """This rank's offset inside its DP replica (0 for the replica's first rank)."""
        return self.tp_rank + self.tp_size * self.cp_rank

    @property
    def writer_offset(self) -> int:
        """Offset of the rank that backs up replicated KV for this rank: TP rank 0 of our CP group."""
        return self.tp_size * self.cp_rank

    @property
    def is_writer(self) -> bool:
        return self.tp_rank == 0

    def control_port(self, base: int) -> int:
        """The port this rank's control server binds, given the configured base port."""
        return self._checked(base, base + self.dp_rank * self.ranks_per_replica + self.rank_offset)

    def writer_port(self, base: int) -> int:
        """The control port of our own replica's writer rank."""
        return self._checked(base, base + self.dp_rank * self.ranks_per_replica + self.writer_offset)

    def source_offset(self, replicated: bool) -> int:
        """What to add to a hinted replica's rank-0 port to reach the rank holding our pool's bytes."""
        return self.writer_offset if replicated else self.rank_offset

    def shard(self, replicated: bool) -> ShardIdentity:
        """The shard identity of a pool: none for replicated bytes, this TP rank for sharded ones."""
        if replicated:
            return ShardIdentity(replicated=True)
        return ShardIdentity(self.tp_rank, self.tp_size)

    def _checked(self, base: int, port: int) -> int:
        if not 0 < base <= MAX_PORT:
            raise ConfigError(f"control_port must be in 1..{MAX_PORT}, got {base}")
        last = base + (self.dp_rank + 1) * self.ranks_per_replica - 1
        if last > MAX_PORT:
            raise ConfigError(
                f"control_port {base} leaves no room for DP replica {self.dp_rank} with "
                f"{self.ranks_per_replica} ranks (needs ports up to {last}); lower control_port"
            )
        return port
