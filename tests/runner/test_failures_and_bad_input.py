"""Failures leave nothing half-done; bad input gets a typed error naming the problem."""

import threading
import time

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockHostMemory
from kvcr.domain.deadlines import Timing
from kvcr.domain.errors import ClosedError, ConfigError, InvalidKeyError, KvcrError, LayoutError
from kvcr.domain.layout import RegionDescriptor
from kvcr.domain.outcomes import Outcome
from kvcr.domain.pools import PoolSpec
from kvcr.ports.inventory import InventoryKind
from tests.support import HostPool, content, kv_pool, make_runner, runner_config, sequence


def new_runner(memory, slots=8, pools=None, inventory=None):
    pools = tuple(pools or (kv_pool(),))
    runner = make_runner(
        pools, slots, memory, MonotonicClock(), InMemoryMetrics(strict=True), inventory or RecordingInventory()
    )
    hosts = {p.name: HostPool(p, 32) for p in pools if p.physical}
    for name, host in hosts.items():
        runner.register_host_pool(name, host.regions)
    return runner, hosts


def stored(runner, host, pages, slots):
    for page, slot in zip(pages, slots, strict=True):
        host.write_page(slot, content(page, host.pool.page_bytes))
    return runner.backup("kv", pages, list(slots))


def test_failed_backup_leaves_no_ready_page_and_changes_nothing_else():
    memory = MockHostMemory()
    inventory = RecordingInventory()
    runner, hosts = new_runner(memory, inventory=inventory)
    kept = sequence(2)
    stored(runner, hosts["kv"], kept, [0, 1])
    before = runner.stats().pools[0]
    memory.fail_after_moves = 1  # the K piece lands, the V piece does not
    doomed = sequence(2, start=500)
    assert stored(runner, hosts["kv"], doomed, [2, 3]) == [False, False]
    after = runner.stats().pools[0]
    assert runner.exists("kv", doomed) == [False, False]
    assert (after.ready, after.free, after.filling) == (before.ready, before.free, 0)
    assert runner.query("kv", kept).prefix == 2
    assert [e.kind for e in inventory.events] == [InventoryKind.STORED]
    memory.fail_after_moves = None
    assert stored(runner, hosts["kv"], doomed, [2, 3]) == [True, True]
    assert runner.stats().counters["kvcr_pages_total{outcome=failed,path=backup}"] == 2
    runner.close()


def test_failed_restore_reports_failure_not_success():
    memory = MockHostMemory()
    runner, hosts = new_runner(memory)
    pages = sequence(2)
    stored(runner, hosts["kv"], pages, [0, 1])
    memory.fail_after_moves = 0
    outcomes = runner.restore("kv", pages, [5, 6])
    assert [o.outcome for o in outcomes] == [Outcome.FAILED, Outcome.FAILED]
    memory.fail_after_moves = None
    assert all(o.restored for o in runner.restore("kv", pages, [5, 6]))  # claims were released
    runner.close()


class GatedMemory(MockHostMemory):
    """Copies wait on a gate: lets a test act while a copy is in flight."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.armed = False

    def copy(self, moves):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.gate.wait(5)
        super().copy(moves)


def test_claimed_pages_are_never_evicted_and_clear_waits_for_readers():
    memory = GatedMemory()
    runner, hosts = new_runner(memory, slots=4)
    host = hosts["kv"]
    reading = sequence(2)
    stored(runner, host, reading, [0, 1])
    memory.armed = True
    outcome = {}
    reader = threading.Thread(target=lambda: outcome.setdefault("r", runner.restore("kv", reading, [10, 11])))
    reader.start()
    assert memory.entered.wait(5)
    # Pressure while the reader holds claims: the two claimed pages must survive.
    newer = sequence(4, start=900)
    assert stored(runner, host, newer, [4, 5, 6, 7]) == [True, True, False, False]
    runner.clear()
    assert runner.stats().pools[0].discarding == 2
    memory.gate.set()
    reader.join(5)
    assert all(o.restored for o in outcome["r"])
    assert host.read_page(10) == content(reading[0], host.pool.page_bytes)
    stats = runner.stats().pools[0]
    assert stats.free == 4 and stats.discarding == 0
    runner.close()


def test_clear_during_backup_discards_the_pages_being_filled():
    memory = GatedMemory()
    runner, hosts = new_runner(memory, slots=4)
    pages = sequence(2)
    for page, slot in zip(pages, [0, 1], strict=True):
        hosts["kv"].write_page(slot, content(page, 512))
    memory.armed = True
    result = {}
    writer = threading.Thread(target=lambda: result.setdefault("w", runner.backup("kv", pages, [0, 1])))
    writer.start()
    assert memory.entered.wait(5)
    runner.clear()
    memory.gate.set()
    writer.join(5)
    assert result["w"] == [False, False]
    assert runner.exists("kv", pages) == [False, False]
    assert runner.stats().pools[0].free == 4
    runner.close()


def test_use_after_close_and_close_frees_memory():
    memory = MockHostMemory()
    runner, hosts = new_runner(memory)
    stored(runner, hosts["kv"], sequence(1), [0])
    assert memory.live_allocations == 1
    runner.close()
    runner.close()  # idempotent
    assert memory.live_allocations == 0
    for call in (
        lambda: runner.backup("kv", sequence(1), [0]),
        lambda: runner.restore("kv", sequence(1), [0]),
        lambda: runner.exists("kv", sequence(1)),
        runner.clear,
    ):
        with pytest.raises(ClosedError):
            call()


def test_close_keeps_memory_when_an_operation_never_ends():
    memory = GatedMemory()
    config = runner_config((kv_pool(),), 4)
    from kvcr.runner import KvcrRunner

    runner = KvcrRunner(
        runner_config((kv_pool(),), 4, timing=Timing(operation_s=0.05, abandon_s=0.1, control_s=0.05)),
        memory=memory,
        clock=MonotonicClock(),
        metrics=InMemoryMetrics(strict=True),
        inventory=RecordingInventory(),
    )
    del config
    host = HostPool(kv_pool(), 8)
    runner.register_host_pool("kv", host.regions)
    memory.armed = True
    writer = threading.Thread(target=runner.backup, args=("kv", sequence(1), [0]))
    writer.start()
    assert memory.entered.wait(5)
    began = time.monotonic()
    with pytest.raises(KvcrError, match="still touch kvcr memory"):
        runner.close()
    assert time.monotonic() - began < 0.8  # gives up after about abandon_s (0.1 s)
    assert memory.live_allocations == 1
    memory.gate.set()
    writer.join(5)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda r: r.backup("nope", [], []), LayoutError, "unknown pool 'nope'"),
        (lambda r: r.backup("kv", sequence(2), [0]), LayoutError, "2 page hashes but 1 host slots"),
        (lambda r: r.backup("kv", ["zz"], [0]), InvalidKeyError, "64 lowercase hex"),
        (lambda r: r.backup("kv", sequence(1), [32]), LayoutError, "outside the host pool"),
        (lambda r: r.backup("kv", sequence(1), [-1]), LayoutError, "outside the host pool"),
        (lambda r: r.backup("kv", sequence(1), [0], parent="x"), InvalidKeyError, "page hash"),
        (lambda r: r.restore("kv", ["A" * 64], [0]), InvalidKeyError, "page hash"),
        (lambda r: r.exists("kv", [None]), InvalidKeyError, "page hash"),
    ],
)
def test_malformed_operations_are_rejected_with_a_message(call, error, match):
    runner, _ = new_runner(MockHostMemory())
    before = runner.stats().pools[0]
    with pytest.raises(error, match=match):
        call(runner)
    assert runner.stats().pools[0] == before
    runner.close()


def test_logical_anchor_holds_no_bytes():
    logical = PoolSpec("kv", (), anchor=True, logical=True)
    from tests.support import indexer_pool

    runner, _ = new_runner(MockHostMemory(), pools=(logical, indexer_pool()))
    with pytest.raises(LayoutError, match="logical"):
        runner.backup("kv", sequence(1), [0])
    runner.close()


def test_host_registration_is_validated():
    runner, hosts = new_runner(MockHostMemory())
    regions = hosts["kv"].regions
    with pytest.raises(LayoutError, match="2 components, 1 host regions"):
        runner.register_host_pool("kv", regions[:1])
    wrong = RegionDescriptor("x", regions[1].base, 128, 32, 128)
    with pytest.raises(LayoutError, match="expects 256"):
        runner.register_host_pool("kv", [regions[0], wrong])
    overlapping = RegionDescriptor("v", regions[0].base + 256, 256, 32, 256)
    with pytest.raises(LayoutError, match="overlap"):
        runner.register_host_pool("kv", [regions[0], overlapping])
    assert runner.register_host_pool("kv", regions)[0].label == "host/kv/k"  # identical: no-op
    with pytest.raises(LayoutError, match="no registered host regions"):
        fresh, _ = new_runner(MockHostMemory())
        fresh._pools["kv"].host = None
        fresh.backup("kv", sequence(1), [0])
    runner.close()


def test_config_errors_name_the_problem():
    pools = (kv_pool(),)
    with pytest.raises(ConfigError, match="holds no page"):
        runner_config(pools, 1).__class__(**{**_fields(runner_config(pools, 1)), "dram_bytes": 10}).slots_per_pool()
    with pytest.raises(ConfigError, match="policy"):
        runner_config(pools, 1, policy="random")
    with pytest.raises(ConfigError, match="unknown pool"):
        runner_config(pools, 1, pool_dram_bytes={"swa": 10})
    with pytest.raises(ConfigError, match="lease_ms"):
        runner_config(pools, 1, timing=Timing(lease_s=1.0, lease_margin_s=2.0))


def _fields(config):
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_an_arena_too_large_to_map_names_dram_bytes():
    from kvcr.adapters.local import MmapHostMemory
    from kvcr.runner import KvcrRunner

    pools = (kv_pool(),)
    with pytest.raises(ConfigError, match="dram_bytes"):
        KvcrRunner(
            runner_config(pools, 1 << 40),  # 512 TiB: more than x86-64 user space holds
            memory=MmapHostMemory(populate=False),
            clock=MonotonicClock(),
            metrics=InMemoryMetrics(strict=True),
            inventory=RecordingInventory(),
        )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(operation_s=1e15), "operation_timeout_ms"),
        (dict(control_s=10.0, operation_s=5.0), "control_timeout_ms"),
        (dict(abandon_s=1.0, operation_s=5.0), "abandon_timeout_ms"),
        (dict(lease_s=0.0), "lease_ms"),
    ],
)
def test_timings_out_of_range_are_refused_by_name(changes, match):
    with pytest.raises(ConfigError, match=match):
        Timing(**changes)


def test_close_waits_for_an_operation_that_ends_within_abandon_s():
    from kvcr.runner import KvcrRunner

    memory = GatedMemory()
    runner = KvcrRunner(
        runner_config((kv_pool(),), 4, timing=Timing(operation_s=0.05, abandon_s=5.0, control_s=0.05)),
        memory=memory,
        clock=MonotonicClock(),
        metrics=InMemoryMetrics(strict=True),
        inventory=RecordingInventory(),
    )
    runner.register_host_pool("kv", HostPool(kv_pool(), 8).regions)
    memory.armed = True
    writer = threading.Thread(target=runner.backup, args=("kv", sequence(1), [0]))
    writer.start()
    assert memory.entered.wait(5)
    opener = threading.Timer(0.1, memory.gate.set)
    opener.start()
    runner.close()  # waits for the copy, then frees the arena
    assert memory.live_allocations == 0
    writer.join(5)
    opener.join(5)


class BlockingInventory(RecordingInventory):
    """Blocks in ``publish`` of a CLEARED event while armed: clear() then holds the runner's lock."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.armed = False

    def publish(self, event):
        if self.armed and event.kind is InventoryKind.CLEARED:
            self.armed = False
            self.entered.set()
            assert self.gate.wait(5)
        super().publish(event)


@pytest.mark.parametrize("operation", ["backup", "restore"])
def test_an_operation_waits_for_the_lock_within_its_deadline(operation):
    inventory = BlockingInventory()
    runner, hosts = new_runner(MockHostMemory(), inventory=inventory)
    page = sequence(1)
    stored(runner, hosts["kv"], page, [0])
    inventory.armed = True
    clearing = threading.Thread(target=runner.clear)
    clearing.start()
    assert inventory.entered.wait(5)  # clear() holds the lock
    opener = threading.Timer(0.1, inventory.gate.set)
    opener.start()
    try:
        if operation == "backup":
            assert runner.backup("kv", page, [0]) == [True]
        else:
            assert [o.outcome for o in runner.restore("kv", page, [1])] == [Outcome.MISS]  # cleared meanwhile
    finally:
        opener.join(5)
        clearing.join(5)
    runner.close()


def test_a_pool_without_host_regions_refuses_what_needs_them():
    runner = make_runner(
        (kv_pool(),), 4, MockHostMemory(), MonotonicClock(), InMemoryMetrics(strict=True), RecordingInventory()
    )
    message = "pool 'kv' has no registered host regions"
    try:
        assert runner.host_regions() == ()
        for call in (
            lambda: runner.pool_host_regions("kv"),
            lambda: runner.backup("kv", sequence(1), [0]),
            lambda: runner.restore("kv", sequence(1), [0]),
            lambda: runner.host_digest("kv", 0, sequence(1)[0]),
        ):
            with pytest.raises(LayoutError) as err:
                call()
            assert str(err.value) == message
    finally:
        runner.close()


def test_an_arena_that_cannot_be_allocated_names_its_size_and_pool():
    from kvcr.ports.errors import RegistrationError
    from kvcr.runner import KvcrRunner

    class NoMemory(MockHostMemory):
        def allocate(self, nbytes, label):
            raise RegistrationError("refused")

    with pytest.raises(ConfigError) as err:
        KvcrRunner(
            runner_config((kv_pool(),), 4),
            memory=NoMemory(),
            clock=MonotonicClock(),
            metrics=InMemoryMetrics(strict=True),
            inventory=RecordingInventory(),
        )
    assert str(err.value) == "dram_bytes: cannot allocate 2048 bytes for pool 'kv' (refused); lower dram_bytes"
