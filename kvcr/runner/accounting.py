"""What the runner tells the outside about its tier: metrics and inventory events, one place.

Every count a dashboard divides (pages and bytes by path and outcome, failures by reason, DRAM
gauges, leases held) and every inventory event a router indexes (pages stored, removed, the tier
cleared) is emitted here, from what an operation's bookkeeping returned. The runner calls it
after the bytes moved; nothing here decides anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvcr.ports.inventory import InventoryEvent, InventoryKind, InventorySink
from kvcr.ports.metric_catalogue import FailureReason, LeaseRole, Path, Result
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metrics import Metrics
from kvcr.runner.pool_state import PoolState

log = logging.getLogger(__name__)


class TierAccounting:
    """Metrics and inventory events of one runner."""

    def __init__(self, metrics: Metrics, inventory: InventorySink) -> None:
        self.metrics = metrics
        self._inventory = inventory

    def pages(self, path: Path, state: PoolState, *, ok: int, miss: int = 0, failed: int = 0) -> None:
        """Pages (and bytes: misses move none) of one operation on ``path``, by outcome."""
        metrics, page_bytes = self.metrics, state.spec.page_bytes
        for outcome, pages in ((Result.OK, ok), (Result.MISS, miss), (Result.FAILED, failed)):
            if pages > 0:
                metrics.increment(M.PAGES, pages, {"path": path, "outcome": outcome})
                if outcome is not Result.MISS:
                    metrics.increment(M.BYTES, pages * page_bytes, {"path": path, "outcome": outcome})

    def backup(
        self,
        state: PoolState,
        page_hashes: Sequence[str],
        parent: str | None,
        stored: list[tuple[int, str]],
        ready: int,
        failed_pages: int,
    ) -> None:
        """One backup batch: ``stored`` (position, page) became READY now; ``ready`` pages of the batch
        are held in all; ``failed_pages`` were lost to a failed copy."""
        for run in _contiguous_runs(stored):
            first = run[0][0]
            self._inventory.publish(
                InventoryEvent(
                    InventoryKind.STORED,
                    state.name,
                    tuple(page for _, page in run),
                    page_hashes[first - 1] if first else parent,
                )
            )
        unstored = len(page_hashes) - ready
        self.pages(Path.BACKUP, state, ok=len(stored), miss=unstored - failed_pages, failed=failed_pages)
        if failed_pages:
            self.failure(Path.BACKUP, FailureReason.COPY_ERROR)
        elif unstored:
            self.failure(Path.BACKUP, FailureReason.NO_SPACE)
        self.pool_gauges(state)

    def local_restore(
        self, state: PoolState, asked: int, claimed: int, corrupt: int, copied: bool, elapsed_s: float
    ) -> None:
        """One local restore of ``asked`` pages: ``claimed`` were held, ``corrupt`` of them failed their digest."""
        path = Path.LOCAL_RESTORE
        self.pages(
            path,
            state,
            ok=claimed - corrupt if copied else 0,
            miss=asked - claimed,
            failed=corrupt if copied else claimed,
        )
        if not copied and claimed:
            self.failure(path, FailureReason.COPY_ERROR)
        if claimed:
            self.metrics.observe(M.RESTORE_SECONDS, elapsed_s, {"path": path})
        if corrupt:
            self.metrics.increment(M.VERIFICATION_FAILURES, corrupt, {"path": path})
            log.error(
                "kvcr: %d pages of pool %s changed in kvcr memory since their backup; dropped, reported as misses",
                corrupt,
                state.name,
            )

    def served(self, pages: int, nbytes: int) -> None:
        """Pages (and their bytes) leased to peers."""
        self.metrics.increment(M.PAGES, pages, {"path": Path.SERVED, "outcome": Result.OK})
        self.metrics.increment(M.BYTES, nbytes, {"path": Path.SERVED, "outcome": Result.OK})

    def reported(self, pages: int, nbytes: int) -> None:
        """Pages (and their bytes) a same-host peer says it took off a slot board (unverifiable: kept apart)."""
        self.metrics.increment(M.PAGES, pages, {"path": Path.SERVED, "outcome": Result.REPORTED})
        self.metrics.increment(M.BYTES, nbytes, {"path": Path.SERVED, "outcome": Result.REPORTED})

    def failure(self, path: Path, reason: FailureReason) -> None:
        self.metrics.increment(M.FAILURES, 1, {"path": path, "reason": reason})

    def evicted(self, state: PoolState, victims: list[str]) -> None:
        if victims:
            self._inventory.publish(InventoryEvent(InventoryKind.REMOVED, state.name, tuple(victims)))
            self.metrics.increment(M.EVICTED_PAGES, len(victims), {"pool": state.name})

    def removed(self, state: PoolState, page: str) -> None:
        """A page dropped because its bytes could no longer be trusted."""
        self._inventory.publish(InventoryEvent(InventoryKind.REMOVED, state.name, (page,)))

    def cleared(self) -> None:
        self._inventory.publish(InventoryEvent(InventoryKind.CLEARED))

    def pool_gauges(self, state: PoolState) -> None:
        """Free, used and total DRAM of a physical pool."""
        if state.arena is None:
            return
        index, page_bytes, labels = state.index, state.spec.page_bytes, {"pool": state.name}
        free = index.free_count * page_bytes
        capacity = index.slots * page_bytes
        self.metrics.set_gauge(M.DRAM_FREE_BYTES, free, labels)
        self.metrics.set_gauge(M.DRAM_USED_BYTES, capacity - free, labels)
        self.metrics.set_gauge(M.DRAM_CAPACITY_BYTES, capacity, labels)

    def leases(self, held: int, expired: int = 0) -> None:
        """Leases this source holds for peers now, and how many just expired."""
        if expired:
            self.metrics.increment(M.LEASES_EXPIRED, expired)
        self.metrics.set_gauge(M.LEASES_HELD, held, {"role": LeaseRole.SOURCE})


def _contiguous_runs(items: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split (index, page) pairs into runs of consecutive indices."""
    runs: list[list[tuple[int, str]]] = []
    for item in items:
        if runs and runs[-1][-1][0] + 1 == item[0]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
