"""Edges of the local copy paths: the plain (unverified) copies, their coalescing, and the runner's caps and gauges."""

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockHostMemory
from kvcr.domain.outcomes import RESTORED
from tests.support import HostPool, content, kv_pool, make_runner, sequence

PIECE = 256  # kv_pool(): two components ("k", "v") of 256 bytes each
PAGE = 2 * PIECE


class RecordingMemory(MockHostMemory):
    """Mock host memory that keeps the moves of every plain copy it performs."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def copy(self, moves):
        self.batches.append(list(moves))
        super().copy(moves)


class Tier:
    def __init__(self, slots=8, **changes):
        self.memory = RecordingMemory()
        self.metrics = InMemoryMetrics(strict=True)
        pools = (kv_pool(PIECE),)
        self.runner = make_runner(
            pools, slots, self.memory, MonotonicClock(), self.metrics, RecordingInventory(), **changes
        )
        self.host = HostPool(pools[0], 64)
        self.runner.register_host_pool("kv", self.host.regions)

    def write(self, pages, slots):
        for page, slot in zip(pages, slots, strict=True):
            self.host.write_page(slot, content(page, PAGE))

    def addresses(self, slot):
        return [r.address(slot) for r in self.host.regions]


@pytest.fixture
def tier():
    made = []

    def make(**changes):
        made.append(Tier(**changes))
        return made[-1]

    yield make
    for t in made:
        t.runner.close()


def test_without_verify_bytes_adjacent_pages_go_as_one_move_per_component_both_ways(tier):
    t = tier(verify_bytes=False)
    pages = sequence(4)
    t.write(pages, range(4))
    assert t.runner.backup("kv", pages, [0, 1, 2, 3]) == [True] * 4
    assert [[m.nbytes for m in batch] for batch in t.memory.batches] == [[4 * PIECE, 4 * PIECE]]
    t.memory.batches.clear()
    assert t.runner.restore("kv", pages, [20, 21, 22, 23]) == [RESTORED] * 4
    assert [[m.nbytes for m in batch] for batch in t.memory.batches] == [[4 * PIECE, 4 * PIECE]]
    for i, page in enumerate(pages):
        assert t.host.read_page(20 + i) == content(page, PAGE)


def test_without_verify_bytes_scattered_host_slots_still_land_page_by_page(tier):
    t = tier(verify_bytes=False)
    pages = sequence(3)
    t.write(pages, [7, 2, 30])
    assert t.runner.backup("kv", pages, [7, 2, 30]) == [True] * 3
    assert t.runner.restore("kv", pages, [40, 11, 5]) == [RESTORED] * 3
    for page, slot in zip(pages, [40, 11, 5], strict=True):
        assert t.host.read_page(slot) == content(page, PAGE)


def test_without_verify_bytes_the_flat_path_stores_and_loads_a_page(tier):
    t = tier(verify_bytes=False)
    page = sequence(1)[0]
    t.write([page], [3])
    assert t.runner.store_page("kv", page, t.addresses(3)) is True
    assert [[m.nbytes for m in batch] for batch in t.memory.batches] == [[PIECE, PIECE]]
    assert t.runner.load_page("kv", page, t.addresses(9)) is True
    assert t.host.read_page(9) == content(page, PAGE)
    assert t.runner.load_page("kv", sequence(1, start=40)[0], t.addresses(10)) is False
    assert t.host.read_page(10) == bytes(PAGE)


def test_the_lease_gauge_reads_zero_at_start_and_the_leases_still_held_after_a_clear(tier):
    t = tier()
    assert t.metrics.snapshot()["kvcr_leases_held{role=source}"] == 0
    pages = sequence(2)
    t.write(pages, [0, 1])
    assert t.runner.backup("kv", pages, [0, 1]) == [True, True]
    grant = t.runner.lease([("kv", pages)], 5.0)
    assert all(s >= 0 for s in grant.slots[0])
    t.runner.clear()
    assert t.metrics.snapshot()["kvcr_leases_held{role=source}"] == 1


def test_a_peer_whose_share_rounds_to_zero_may_still_pin_one_page(tier):
    # 8 slots: the pool's lease cap is 4; a peer's share of it is 4 * 0.1, which rounds down to 0.
    t = tier(slots=8, max_peer_leased_fraction=0.1)
    pages = sequence(3)
    t.write(pages, range(3))
    assert all(t.runner.backup("kv", pages, [0, 1, 2]))
    grant = t.runner.lease([("kv", pages)], 5.0, holder=7)
    assert sum(s >= 0 for s in grant.slots[0]) == 1
    assert grant.over_quota == 2
