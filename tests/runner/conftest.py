import pytest

from kvcr.adapters.local import InMemoryMetrics, MmapHostMemory, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockHostMemory
from tests.support import HostPool, kv_pool, make_runner


@pytest.fixture(params=["mock", "mmap"])
def memory(request):
    mem = MockHostMemory() if request.param == "mock" else MmapHostMemory()
    yield mem
    if isinstance(mem, MmapHostMemory):
        mem.close()


@pytest.fixture
def inventory():
    return RecordingInventory()


@pytest.fixture
def build(memory, inventory):
    """build(pools, slots, host_pages=...) -> (runner, {pool: HostPool})"""
    made = []

    def _build(pools=None, slots=16, host_pages=64, **changes):
        pools = tuple(pools or (kv_pool(),))
        runner = make_runner(pools, slots, memory, MonotonicClock(), InMemoryMetrics(strict=True), inventory, **changes)
        hosts = {}
        for p in pools:
            if p.physical:
                hosts[p.name] = HostPool(p, host_pages)
                runner.register_host_pool(p.name, hosts[p.name].regions)
        made.append(runner)
        return runner, hosts

    yield _build
    for runner in made:
        runner.close()
