"""Arenas and staging buffers: where each component's pieces live, how many buffers exist, what is freed;
the protocol's frame checks."""

import json

import pytest

from kvcr.adapters.local import MonotonicClock
from kvcr.adapters.mock import MockDataPlane, MockFabric, MockHostMemory
from kvcr.domain.layout import ComponentSpec
from kvcr.domain.pools import PoolSpec
from kvcr.ports.errors import RegistrationError
from kvcr.runner import protocol
from kvcr.runner.arena import Arena
from kvcr.runner.protocol import FrameError, RefusalCode
from kvcr.runner.staging import StagingPool
from tests.support import indexer_pool, kv_pool

THREE = PoolSpec("mix", (ComponentSpec("a", 16), ComponentSpec("b", 32), ComponentSpec("c", 8)), anchor=True)


def plane():
    return MockDataPlane(MockFabric(), "T", MonotonicClock())


# ---------------------------------------------------------------------------------------------- arena


def test_an_arena_lays_each_component_out_densely_one_after_another():
    memory = MockHostMemory()
    arena = Arena(THREE, 4, memory)
    assert arena.pool is THREE and arena.slots == 4
    base = arena.allocation.address
    assert arena.allocation.label == "kvcr/mix" and arena.allocation.nbytes == 4 * 56
    assert [(r.label, r.base - base, r.stride, r.count) for r in arena.regions] == [
        ("kvcr/mix/a", 0, 16, 4),
        ("kvcr/mix/b", 64, 32, 4),
        ("kvcr/mix/c", 192, 8, 4),
    ]
    arena.release()
    arena.release()  # twice is harmless
    assert arena.allocation is None and memory.live_allocations == 0


# ---------------------------------------------------------------------------------------------- staging


def test_staging_buffers_are_private_dense_and_labelled():
    memory, data_plane = MockHostMemory(), plane()
    staging = StagingPool(memory, data_plane, 3)
    buffer = staging.take(THREE)
    base = buffer.allocation.address
    assert buffer.allocation.label == "kvcr-staging/mix" and buffer.allocation.nbytes == 3 * 56
    assert [(r.base - base, r.stride, r.count) for r in buffer.regions] == [(0, 16, 3), (48, 32, 3), (144, 8, 3)]
    assert buffer.extents(2) == [(base + 32, 16), (base + 48 + 64, 32), (base + 144 + 16, 8)]
    assert json.loads(data_plane.describe())["exposed"] == {}  # never offered to peers


def test_there_are_four_staging_buffers_per_pool_by_default():
    staging = StagingPool(MockHostMemory(), plane(), 2)
    taken = [staging.take(kv_pool()) for _ in range(4)]
    assert all(b is not None for b in taken) and staging.take(kv_pool()) is None
    assert staging.take(indexer_pool()) is not None  # the cap is per pool


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_the_buffer_cap_counts_every_buffer_taken(cap):
    staging = StagingPool(MockHostMemory(), plane(), 2, max_buffers=cap)
    taken = [staging.take(kv_pool()) for _ in range(cap)]
    assert None not in taken and staging.take(kv_pool()) is None
    staging.give_back(taken[0])
    assert staging.take(kv_pool()) is taken[0]  # a given-back buffer is reused, not a new one


def test_a_buffer_that_fails_to_register_is_freed_and_not_counted():
    memory, data_plane = MockHostMemory(), plane()
    staging = StagingPool(memory, data_plane, 2, max_buffers=1)
    real = data_plane.register
    calls = []

    def register(regions, *, exposed):
        calls.append(exposed)
        if len(calls) == 1:
            raise RegistrationError("injected")
        return real(regions, exposed=exposed)

    data_plane.register = register
    with pytest.raises(RegistrationError):
        staging.take(kv_pool())
    assert memory.live_allocations == 0
    assert staging.take(kv_pool()) is not None  # the failed one did not use up the cap
    assert staging.take(kv_pool()) is None  # nor did it give one back: the cap is still one
    assert calls == [False, False]


def test_a_quarantined_buffer_is_reused_only_once_released():
    staging = StagingPool(MockHostMemory(), plane(), 2, max_buffers=1)
    buffer = staging.take(kv_pool())
    staging.quarantine(buffer)
    assert staging.quarantined == 1 and staging.take(kv_pool()) is None
    staging.release_quarantined(buffer)
    staging.release_quarantined(buffer)  # twice is harmless
    assert staging.quarantined == 0 and staging.take(kv_pool()) is buffer


def test_closing_frees_and_deregisters_every_buffer_but_the_quarantined():
    memory, data_plane = MockHostMemory(), plane()
    staging = StagingPool(memory, data_plane, 2, max_buffers=2)
    kept, stuck = staging.take(kv_pool()), staging.take(kv_pool())
    staging.give_back(kept)
    staging.quarantine(stuck)
    staging.close()
    assert memory.live_allocations == 1  # the quarantined buffer's memory is never freed
    with pytest.raises(RegistrationError):
        data_plane.register(stuck.regions, exposed=False)  # still registered: late bytes may land there
    data_plane.register(kept.regions, exposed=False)  # the other one is gone from the data plane


# ---------------------------------------------------------------------------------------------- frames


def test_frames_of_another_protocol_or_with_a_broken_body_are_malformed():
    wrong_magic = protocol._encoder.encode(("not-kvcr", protocol.PROTOCOL_VERSION, b""))
    broken_body = protocol._encoder.encode((protocol.MAGIC, protocol.PROTOCOL_VERSION, b"\xc1"))
    for frame in (wrong_magic, broken_body, b"\x93"):
        with pytest.raises(FrameError) as err:
            protocol.decode(frame)
        assert err.value.code is RefusalCode.MALFORMED and str(err.value) == "malformed"
    assert str(FrameError(RefusalCode.VERSION)) == "version"
